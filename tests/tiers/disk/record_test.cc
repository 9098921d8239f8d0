#include "tiers/disk/record.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/layout.h"

namespace kvtier {
namespace {

using Page = std::vector<uint8_t>;

// Field offsets as docs/disk-format.md states them; the tests pin the format
// to the document, not to the implementation's constants.
constexpr size_t kVersionAt = 8;
constexpr size_t kEncodedBytesAt = 12;
constexpr size_t kOwnerLenAt = 72;
constexpr size_t kOwnerAt = 76;
constexpr size_t kFixedEncodedBytes = 84;

uint32_t LoadU32(const Page& page, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v |= static_cast<uint32_t>(page[at + i]) << (8 * i);
  return v;
}
uint64_t LoadU64(const Page& page, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v |= static_cast<uint64_t>(page[at + i]) << (8 * i);
  return v;
}
void StoreU32(Page& page, size_t at, uint32_t v) {
  for (size_t i = 0; i < 4; ++i) page[at + i] = static_cast<uint8_t>(v >> (8 * i));
}
void StoreU64(Page& page, size_t at, uint64_t v) {
  for (size_t i = 0; i < 8; ++i) page[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

// Recomputes the header checksum after the test edits fields, so that the
// check under test is the one that fires rather than the checksum. `owner_len`
// says where the checksum sits.
void Reseal(Page& page, size_t owner_len) {
  const size_t at = kOwnerAt + owner_len;
  StoreU64(page, at, XXH3_64bits(page.data(), at));
}

RecordHeader RandomHeader(std::mt19937_64& rng) {
  RecordHeader h;
  for (auto& b : h.key.bytes) b = static_cast<uint8_t>(rng());
  for (auto& b : h.ns.bytes) b = static_cast<uint8_t>(rng());
  h.sequence = rng();
  h.payload_bytes = 1 + rng() % Layout::kMaxBlockBytes;
  h.payload_checksum = rng();
  // Any bytes, NUL included: the owner is length-prefixed, not a C string.
  h.owner.resize(rng() % (RecordHeader::kMaxOwnerBytes + 1));
  for (char& c : h.owner) c = static_cast<char>(rng());
  return h;
}

RecordHeader SampleHeader(size_t owner_len) {
  RecordHeader h;
  for (size_t i = 0; i < 16; ++i) {
    h.key.bytes[i] = static_cast<uint8_t>(i + 1);
    h.ns.bytes[i] = static_cast<uint8_t>(0xa0 + i);
  }
  h.sequence = 0x0102030405060708ull;
  h.payload_bytes = 123456;
  h.payload_checksum = 0xdeadbeefcafef00dull;
  h.owner = std::string(owner_len, 't');
  return h;
}

Page Encode(const RecordHeader& h) {
  Page page(RecordHeader::kBytes);
  EncodeRecordHeader(h, page);
  return page;
}

// Expects kCorruption whose message mentions `what`.
void ExpectCorruption(const Page& page, const std::string& what) {
  const Result<RecordHeader> decoded = DecodeRecordHeader(page);
  ASSERT_FALSE(decoded.has_value()) << "expected a failure naming " << what;
  EXPECT_EQ(decoded.error().code(), StatusCode::kCorruption) << decoded.error();
  EXPECT_NE(decoded.error().message().find(what), std::string::npos) << decoded.error();
}

TEST(RecordTest, RandomHeadersRoundTrip) {
  std::mt19937_64 rng(20240611);
  for (int i = 0; i < 500; ++i) {
    const RecordHeader h = RandomHeader(rng);
    // A dirty buffer: Encode must zero what it does not write.
    Page page(RecordHeader::kBytes, 0xee);
    EncodeRecordHeader(h, page);
    const Result<RecordHeader> decoded = DecodeRecordHeader(page);
    ASSERT_TRUE(decoded.has_value()) << decoded.error();
    EXPECT_EQ(*decoded, h);
    const size_t encoded_bytes = kFixedEncodedBytes + h.owner.size();
    EXPECT_EQ(LoadU32(page, kEncodedBytesAt), encoded_bytes);
    EXPECT_TRUE(std::all_of(page.begin() + static_cast<std::ptrdiff_t>(encoded_bytes), page.end(),
                            [](uint8_t b) { return b == 0; }))
        << "the tail past the encoded part must be zero";
  }
}

TEST(RecordTest, LayoutMatchesTheDocument) {
  const RecordHeader h = SampleHeader(3);
  const Page page = Encode(h);
  EXPECT_EQ(std::string(page.begin(), page.begin() + 8), "PVTREC01");
  EXPECT_EQ(LoadU64(page, 0), RecordHeader::kMagic);
  EXPECT_EQ(LoadU32(page, kVersionAt), 1u);
  EXPECT_EQ(LoadU32(page, kEncodedBytesAt), kFixedEncodedBytes + 3);
  EXPECT_TRUE(std::equal(h.key.bytes.begin(), h.key.bytes.end(), page.begin() + 16));
  EXPECT_TRUE(std::equal(h.ns.bytes.begin(), h.ns.bytes.end(), page.begin() + 32));
  EXPECT_EQ(LoadU64(page, 48), h.sequence);
  EXPECT_EQ(LoadU64(page, 56), h.payload_bytes);
  EXPECT_EQ(LoadU64(page, 64), h.payload_checksum);
  EXPECT_EQ(LoadU32(page, kOwnerLenAt), 3u);
  EXPECT_EQ(std::string(page.begin() + kOwnerAt, page.begin() + kOwnerAt + 3), "ttt");
  EXPECT_EQ(LoadU64(page, kOwnerAt + 3), XXH3_64bits(page.data(), kOwnerAt + 3));
}

TEST(RecordTest, EverySingleBitFlipInTheEncodedPartIsRejected) {
  for (size_t owner_len : {size_t{0}, size_t{7}, RecordHeader::kMaxOwnerBytes}) {
    const Page good = Encode(SampleHeader(owner_len));
    const size_t encoded_bytes = kFixedEncodedBytes + owner_len;
    for (size_t bit = 0; bit < encoded_bytes * 8; ++bit) {
      Page page = good;
      page[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      const Result<RecordHeader> decoded = DecodeRecordHeader(page);
      ASSERT_FALSE(decoded.has_value()) << "owner_len " << owner_len << ", bit " << bit;
      EXPECT_EQ(decoded.error().code(), StatusCode::kCorruption);
    }
  }
}

TEST(RecordTest, AnAnnotationMakesAVersion2RecordThatRoundTripsAndEveryBitFlipIsRejected) {
  for (size_t annotation_len : {size_t{1}, size_t{100}, RecordHeader::kMaxAnnotationBytes}) {
    RecordHeader h = SampleHeader(7);
    h.annotation.assign(annotation_len, '\0');
    for (size_t i = 0; i < annotation_len; ++i) h.annotation[i] = static_cast<char>(i * 7 + 1);
    const Page good = Encode(h);
    EXPECT_EQ(LoadU32(good, kVersionAt), RecordHeader::kAnnotatedVersion);
    const size_t annotation_at = kOwnerAt + 7;
    EXPECT_EQ(LoadU32(good, annotation_at), annotation_len);
    EXPECT_EQ(std::string(good.begin() + annotation_at + 4, good.begin() + annotation_at + 4 + annotation_len),
              h.annotation);
    const size_t encoded_bytes = kFixedEncodedBytes + 7 + 4 + annotation_len;
    EXPECT_EQ(LoadU32(good, kEncodedBytesAt), encoded_bytes);
    const Result<RecordHeader> decoded = DecodeRecordHeader(good);
    ASSERT_TRUE(decoded.has_value()) << decoded.error();
    EXPECT_EQ(*decoded, h);
    if (annotation_len > 100) continue;  // the flips below: the small ones suffice
    for (size_t bit = 0; bit < encoded_bytes * 8; ++bit) {
      Page page = good;
      page[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      ASSERT_FALSE(DecodeRecordHeader(page).has_value()) << "annotation_len " << annotation_len << ", bit " << bit;
    }
  }
  // Without one it stays a version-1 record, byte for byte.
  EXPECT_EQ(LoadU32(Encode(SampleHeader(7)), kVersionAt), RecordHeader::kVersion);
}

TEST(RecordTest, WrongMagicIsRejected) {
  Page page = Encode(SampleHeader(4));
  page[7] = '2';  // "PVTREC02"
  Reseal(page, 4);
  ExpectCorruption(page, "magic");
}

TEST(RecordTest, WrongVersionIsRejected) {
  for (uint32_t version : {0u, 3u, 0xffffffffu}) {
    Page page = Encode(SampleHeader(4));
    StoreU32(page, kVersionAt, version);
    Reseal(page, 4);
    ExpectCorruption(page, "version");
  }
}

TEST(RecordTest, OwnerTooLongIsRejected) {
  // A 65-byte owner with lengths and checksum consistent with it: only the
  // owner limit can reject it.
  Page page = Encode(SampleHeader(RecordHeader::kMaxOwnerBytes));
  const size_t owner_len = RecordHeader::kMaxOwnerBytes + 1;
  page[kOwnerAt + RecordHeader::kMaxOwnerBytes] = 't';
  StoreU32(page, kOwnerLenAt, static_cast<uint32_t>(owner_len));
  Reseal(page, owner_len);
  // encoded_bytes (still 148, in range) is checked before owner_len, so the
  // owner limit fires; and with encoded_bytes agreeing with it (149, in
  // range since version 2 records are longer), too.
  ExpectCorruption(page, "owner_len");
  StoreU32(page, kEncodedBytesAt, static_cast<uint32_t>(kFixedEncodedBytes + owner_len));
  ExpectCorruption(page, "owner_len");
}

TEST(RecordTest, EncodedBytesMustAgreeWithOwnerLen) {
  Page page = Encode(SampleHeader(5));
  StoreU32(page, kEncodedBytesAt, static_cast<uint32_t>(kFixedEncodedBytes + 6));
  Reseal(page, 5);
  ExpectCorruption(page, "inconsistent");
  StoreU32(page, kEncodedBytesAt, 4096);
  ExpectCorruption(page, "out of range");
}

TEST(RecordTest, PayloadBytesAboveTheBlockLimitIsRejected) {
  RecordHeader h = SampleHeader(0);
  h.payload_bytes = Layout::kMaxBlockBytes;
  EXPECT_TRUE(DecodeRecordHeader(Encode(h)).has_value());
  h.payload_bytes = Layout::kMaxBlockBytes + 1;
  ExpectCorruption(Encode(h), "payload_bytes");
  h.payload_bytes = 0;  // the format forbids an empty payload
  ExpectCorruption(Encode(h), "payload_bytes 0");
}

TEST(RecordTest, ZeroPageIsRejected) { ExpectCorruption(Page(RecordHeader::kBytes, 0), "magic"); }

TEST(RecordTest, ShortInputIsRejected) {
  Page page = Encode(SampleHeader(0));
  page.resize(RecordHeader::kBytes - 1);
  ExpectCorruption(page, "4095 bytes");
  ExpectCorruption(Page{}, "0 bytes");
}

TEST(RecordTest, LongerInputDecodesItsFirstPage) {
  // Callers may hand the whole record (header and payload) to the decoder.
  const RecordHeader h = SampleHeader(2);
  Page page = Encode(h);
  page.resize(RecordHeader::kBytes * 3, 0x5a);
  const Result<RecordHeader> decoded = DecodeRecordHeader(page);
  ASSERT_TRUE(decoded.has_value()) << decoded.error();
  EXPECT_EQ(*decoded, h);
}

TEST(RecordTest, TornHeaderIsRejected) {
  const Page good = Encode(SampleHeader(10));
  // The first half never landed (a sector-granular tear, zero beneath).
  Page page = good;
  std::fill(page.begin(), page.begin() + RecordHeader::kBytes / 2, uint8_t{0});
  ExpectCorruption(page, "magic");

  // Torn anywhere inside the encoded part: a new prefix over zeros, and a new
  // prefix over another record's header that was at the same place.
  RecordHeader other = SampleHeader(10);
  other.key.bytes[15] ^= 0xff;
  other.sequence = 1;
  other.payload_bytes = 4096;
  other.owner = "other-tenant";
  const Page old = Encode(other);
  const size_t encoded_bytes = kFixedEncodedBytes + 10;
  for (size_t keep = 1; keep < encoded_bytes; ++keep) {
    Page over_zero(RecordHeader::kBytes, 0);
    std::copy(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep), over_zero.begin());
    EXPECT_FALSE(DecodeRecordHeader(over_zero).has_value()) << "kept " << keep;
    Page over_old = old;
    std::copy(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep), over_old.begin());
    // While the kept prefix holds no byte that differs, the page still is the
    // old header, intact and valid; any real mix of the two must be rejected.
    if (over_old != old) {
      EXPECT_FALSE(DecodeRecordHeader(over_old).has_value()) << "kept " << keep;
    }
  }
}

TEST(RecordTest, PayloadChecksumIsXxh3_64) {
  std::mt19937_64 rng(7);
  for (size_t size : {size_t{0}, size_t{1}, size_t{240}, size_t{4096}, size_t{100000}}) {
    std::vector<uint8_t> payload(size);
    for (auto& b : payload) b = static_cast<uint8_t>(rng());
    EXPECT_EQ(PayloadChecksum(payload), XXH3_64bits(payload.data(), payload.size())) << size;
  }
}

TEST(RecordTest, ABareRecordIsItsPayloadInWholePages) {
  EXPECT_EQ(RecordBytes(1), 4096u);
  EXPECT_EQ(RecordBytes(4096), 4096u);
  EXPECT_EQ(RecordBytes(4097), 8192u);
  EXPECT_EQ(RecordBytes(16384), 16384u);
  EXPECT_EQ(RecordBytes(2u << 20), 2u << 20);
  EXPECT_EQ(RecordBytes(2806, RecordFormat::kBare), 4096u);
}

TEST(RecordTest, AnOlderRawRecordHasAHeaderPage) {
  constexpr RecordFormat kOld = LegacyFormat(/*packed=*/false);
  static_assert(kOld == RecordFormat::kHeaderPage);
  EXPECT_EQ(RecordBytes(0, kOld), 4096u);
  EXPECT_EQ(RecordBytes(1, kOld), 8192u);
  EXPECT_EQ(RecordBytes(4096, kOld), 8192u);
  EXPECT_EQ(RecordBytes(4097, kOld), 12288u);
}

TEST(RecordTest, AnOlderPackedRecordHoldsItsPayloadAndTrailerInWholePages) {
  constexpr RecordFormat kOld = LegacyFormat(/*packed=*/true);
  static_assert(kOld == RecordFormat::kTrailer);
  // The trailer shares the payload's last page when 96 bytes are left.
  EXPECT_EQ(RecordBytes(1, kOld), 4096u);
  EXPECT_EQ(RecordBytes(4000, kOld), 4096u);
  EXPECT_EQ(RecordBytes(4001, kOld), 8192u);
  EXPECT_EQ(RecordBytes(4096, kOld), 8192u);
  EXPECT_EQ(RecordBytes(12000, kOld), 12288u);
  EXPECT_EQ(PackedHeadBytes(4000), 0u);
  EXPECT_EQ(PackedHeadBytes(12000), 8192u);
}

// Trailer offsets as docs/disk-format.md states them.
constexpr size_t kTrailerRawBytesAt = 72;
constexpr size_t kTrailerCodecAt = 80;
constexpr size_t kTrailerDTypeAt = 81;
constexpr size_t kTrailerGroupAt = 84;
constexpr size_t kTrailerChecksumAt = 88;

RecordHeader SamplePacked() {
  RecordHeader h = SampleHeader(0);
  h.codec = CodecKind::kFp8;
  h.dtype = DType::kBf16;
  h.group_elems = 128;
  h.raw_bytes = 2 * h.payload_bytes;
  return h;
}

Page EncodeTrailer(const RecordHeader& h) {
  Page trailer(kRecordTrailerBytes);
  EncodeRecordTrailer(h, trailer);
  return trailer;
}

void ResealTrailer(Page& trailer) {
  StoreU64(trailer, kTrailerChecksumAt, XXH3_64bits(trailer.data(), kTrailerChecksumAt));
}

void ExpectTrailerCorruption(const Page& trailer, const std::string& what) {
  const Result<RecordHeader> decoded = DecodeRecordTrailer(trailer);
  ASSERT_FALSE(decoded.has_value()) << "expected a failure naming " << what;
  EXPECT_EQ(decoded.error().code(), StatusCode::kCorruption) << decoded.error();
  EXPECT_NE(decoded.error().message().find(what), std::string::npos) << decoded.error();
}

TEST(RecordTest, TrailerRoundTripsAndMatchesTheDocument) {
  RecordHeader h = SamplePacked();
  const Page t = EncodeTrailer(h);
  EXPECT_EQ(std::string(t.begin(), t.begin() + 8), "PVTREC01");
  EXPECT_EQ(LoadU32(t, kVersionAt), 3u);
  EXPECT_EQ(LoadU32(t, kEncodedBytesAt), 96u);
  EXPECT_TRUE(std::equal(h.key.bytes.begin(), h.key.bytes.end(), t.begin() + 16));
  EXPECT_TRUE(std::equal(h.ns.bytes.begin(), h.ns.bytes.end(), t.begin() + 32));
  EXPECT_EQ(LoadU64(t, 48), h.sequence);
  EXPECT_EQ(LoadU64(t, 56), h.payload_bytes);
  EXPECT_EQ(LoadU64(t, 64), h.payload_checksum);
  EXPECT_EQ(LoadU64(t, kTrailerRawBytesAt), h.raw_bytes);
  EXPECT_EQ(t[kTrailerCodecAt], 2u);
  EXPECT_EQ(t[kTrailerDTypeAt], 2u);
  EXPECT_EQ(LoadU32(t, kTrailerGroupAt), 128u);
  EXPECT_EQ(LoadU64(t, kTrailerChecksumAt), XXH3_64bits(t.data(), kTrailerChecksumAt));

  // Decoded from the end of a longer tail; the owner is not in a trailer.
  Page tail(4096, 0);
  std::copy(t.begin(), t.end(), tail.end() - 96);
  Result<RecordHeader> back = DecodeRecordTrailer(tail);
  ASSERT_TRUE(back.has_value()) << back.error();
  EXPECT_EQ(*back, h);

  h.codec = CodecKind::kLossless;
  h.dtype = DType::kFp32;
  h.group_elems = 0;
  back = DecodeRecordTrailer(EncodeTrailer(h));
  ASSERT_TRUE(back.has_value()) << back.error();
  EXPECT_EQ(*back, h);
}

TEST(RecordTest, EverySingleBitFlipOfATrailerIsRejected) {
  const Page good = EncodeTrailer(SamplePacked());
  for (size_t bit = 0; bit < good.size() * 8; ++bit) {
    Page bad = good;
    bad[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    const Result<RecordHeader> decoded = DecodeRecordTrailer(bad);
    ASSERT_FALSE(decoded.has_value()) << "bit " << bit;
    EXPECT_EQ(decoded.error().code(), StatusCode::kCorruption);
  }
}

TEST(RecordTest, TrailerFieldsOutOfRangeAreRejectedEvenWithAGoodChecksum) {
  auto edited = [](auto edit) {
    Page t = EncodeTrailer(SamplePacked());
    edit(t);
    ResealTrailer(t);
    return t;
  };
  ExpectTrailerCorruption(edited([](Page& t) { t[kTrailerCodecAt] = 0; }), "codec 0");
  ExpectTrailerCorruption(edited([](Page& t) { t[kTrailerCodecAt] = 3; }), "codec 3");
  ExpectTrailerCorruption(edited([](Page& t) { t[kTrailerDTypeAt] = 9; }), "dtype 9");
  ExpectTrailerCorruption(edited([](Page& t) { t[kTrailerDTypeAt] = 3; }), "fp8 needs fp16 or bf16");
  ExpectTrailerCorruption(edited([](Page& t) { StoreU32(t, kTrailerGroupAt, 0); }), "group_elems");
  ExpectTrailerCorruption(edited([](Page& t) { t[82] = 1; }), "reserved");
  ExpectTrailerCorruption(edited([](Page& t) { StoreU64(t, kTrailerRawBytesAt, 0); }), "raw_bytes");
  ExpectTrailerCorruption(edited([](Page& t) { StoreU64(t, 56, 0); }), "payload_bytes 0");
  ExpectTrailerCorruption(edited([](Page& t) { StoreU64(t, kTrailerRawBytesAt, LoadU64(t, 56)); }),
                          "out of range");
  ExpectTrailerCorruption(
      edited([](Page& t) { StoreU64(t, kTrailerRawBytesAt, Layout::kMaxBlockBytes + 1); }), "raw_bytes");
  ExpectTrailerCorruption(edited([](Page& t) { StoreU32(t, kVersionAt, 2); }), "version 2");
  ExpectTrailerCorruption(edited([](Page& t) { StoreU32(t, kEncodedBytesAt, 95); }), "trailer_bytes");
  ExpectTrailerCorruption(Page(kRecordTrailerBytes, 0), "magic");
  ExpectTrailerCorruption(Page(95, 0), "need 96");
  // A raw record's header page is not a trailer, nor the other way round.
  Page header = Encode(SampleHeader(0));
  EXPECT_FALSE(DecodeRecordTrailer(std::span<const uint8_t>(header.data(), 96)).has_value());
}

}  // namespace
}  // namespace kvtier
