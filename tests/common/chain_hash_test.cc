#include "common/chain_hash.h"

#include <xxhash.h>

#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

// splitmix64(seed, n) as docs/hashing.md defines it.
std::vector<uint8_t> SplitMix64Bytes(uint64_t state, size_t n) {
  std::vector<uint8_t> out;
  while (out.size() < n) {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    for (int i = 0; i < 8 && out.size() < n; ++i) out.push_back(static_cast<uint8_t>(z >> (8 * i)));
  }
  return out;
}

std::vector<std::string> Words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// The `name = value` lines of the ```vectors block of docs/hashing.md.
std::map<std::string, std::string> ReadVectors() {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/docs/hashing.md");
  EXPECT_TRUE(in.good()) << "cannot open docs/hashing.md";
  std::map<std::string, std::string> vectors;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line == "```vectors") {
      inside = true;
    } else if (inside && line == "```") {
      break;
    } else if (inside) {
      const size_t eq = line.find(" = ");
      EXPECT_NE(eq, std::string::npos) << line;
      if (eq != std::string::npos) vectors[line.substr(0, eq)] = line.substr(eq + 3);
    }
  }
  return vectors;
}

Secret SecretFromSpec(const std::string& spec) {
  // "splitmix64(SEED, N)"
  unsigned long long seed = 0, n = 0;
  EXPECT_EQ(std::sscanf(spec.c_str(), "splitmix64(%llu, %llu)", &seed, &n), 2) << spec;
  return Secret::FromBytes(SplitMix64Bytes(seed, n)).value();
}

Layout LayoutFromSpec(const std::string& spec) {
  std::map<std::string, std::string> f;
  for (const std::string& w : Words(spec)) {
    const size_t eq = w.find('=');
    f[w.substr(0, eq)] = w.substr(eq + 1);
  }
  LayoutSpec s;
  s.model_id = f.at("model_id");
  s.num_layers = std::stoul(f.at("num_layers"));
  s.kv_kind = ParseKvKind(f.at("kv_kind")).value();
  s.num_kv_heads = std::stoul(f.at("num_kv_heads"));
  s.head_dim = std::stoul(f.at("head_dim"));
  s.dtype = ParseDType(f.at("dtype")).value();
  s.block_tokens = std::stoul(f.at("block_tokens"));
  s.tp_rank = std::stoul(f.at("tp_rank"));
  s.tp_size = std::stoul(f.at("tp_size"));
  s.scale_bytes_per_layer = std::stoul(f.at("scale_bytes_per_layer"));
  return Layout::Create(s).value();
}

std::vector<uint32_t> TokensFromSpec(const std::string& spec) {
  std::vector<uint32_t> tokens;
  for (const std::string& w : Words(spec)) tokens.push_back(static_cast<uint32_t>(std::stoul(w)));
  return tokens;
}

std::vector<std::string> Hex(const std::vector<BlockKey>& keys) {
  std::vector<std::string> out;
  for (const BlockKey& k : keys) out.push_back(k.ToHex());
  return out;
}

class HashingVectorsTest : public ::testing::Test {
 protected:
  std::map<std::string, std::string> v_ = ReadVectors();
};

TEST_F(HashingVectorsTest, DocumentHasEveryVector) {
  for (const char* name : {"secret.hash", "secret.salt_a", "secret.salt_b", "layout.1", "fingerprint.1",
                           "layout.2", "fingerprint.2", "tokens", "keys", "extra.1", "keys.extra",
                           "stored.a", "stored.b", "engine16", "engine32"}) {
    EXPECT_TRUE(v_.count(name)) << "docs/hashing.md lacks vector " << name;
  }
}

TEST_F(HashingVectorsTest, LayoutFingerprints) {
  EXPECT_EQ(LayoutFromSpec(v_["layout.1"]).fingerprint().ToHex(), v_["fingerprint.1"]);
  EXPECT_EQ(LayoutFromSpec(v_["layout.2"]).fingerprint().ToHex(), v_["fingerprint.2"]);
}

TEST_F(HashingVectorsTest, ChainKeys) {
  const ChainHasher hasher(SecretFromSpec(v_["secret.hash"]), LayoutFromSpec(v_["layout.1"]));
  const std::vector<uint32_t> tokens = TokensFromSpec(v_["tokens"]);
  Result<std::vector<BlockKey>> keys = hasher.ComputeKeys(tokens);
  ASSERT_TRUE(keys.has_value()) << keys.error();
  EXPECT_EQ(Hex(*keys), Words(v_["keys"]));

  const std::vector<ExtraKeys> extra = {{}, Words(v_["extra.1"])};
  Result<std::vector<BlockKey>> with_extra = hasher.ComputeKeys(tokens, extra);
  ASSERT_TRUE(with_extra.has_value()) << with_extra.error();
  EXPECT_EQ(Hex(*with_extra), Words(v_["keys.extra"]));
}

TEST_F(HashingVectorsTest, FirstKeyMatchesTheDocumentedEncoding) {
  // Builds block 0's input by hand, straight from the prose of the spec, and
  // hashes it with xxHash directly: catches a spec and an implementation that
  // drifted apart together.
  const Layout layout = LayoutFromSpec(v_["layout.1"]);
  const std::vector<uint8_t> secret = SplitMix64Bytes(1, 192);
  std::vector<uint8_t> in(layout.fingerprint().bytes.begin(), layout.fingerprint().bytes.end());
  auto u32 = [&](uint32_t x) {
    for (int i = 0; i < 4; ++i) in.push_back(static_cast<uint8_t>(x >> (8 * i)));
  };
  u32(4);
  for (uint32_t t : {1u, 1001u, 2001u, 3001u}) u32(t);
  u32(0);
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_withSecret(in.data(), in.size(), secret.data(), secret.size()));
  BlockKey expected;
  std::memcpy(expected.bytes.data(), c.digest, 16);
  EXPECT_EQ(expected.ToHex(), Words(v_["keys"]).at(0));
}

TEST_F(HashingVectorsTest, StoredKeys) {
  const Layout layout = LayoutFromSpec(v_["layout.1"]);
  const BlockKey key0 = BlockKey::FromHex(Words(v_["keys"]).at(0)).value();
  EXPECT_EQ(DeriveStoredKey(SecretFromSpec(v_["secret.salt_a"]), layout.fingerprint(), key0).ToHex(),
            v_["stored.a"]);
  EXPECT_EQ(DeriveStoredKey(SecretFromSpec(v_["secret.salt_b"]), layout.fingerprint(), key0).ToHex(),
            v_["stored.b"]);
}

TEST_F(HashingVectorsTest, EngineHashes) {
  const ChainHasher hasher(SecretFromSpec(v_["secret.hash"]), LayoutFromSpec(v_["layout.1"]));
  std::vector<uint8_t> h16(16), h32(32);
  for (size_t i = 0; i < h32.size(); ++i) h32[i] = static_cast<uint8_t>(i);
  std::copy(h32.begin(), h32.begin() + 16, h16.begin());
  EXPECT_EQ(hasher.KeyFromEngineHash(h16).value().ToHex(), v_["engine16"]);
  EXPECT_EQ(hasher.KeyFromEngineHash(h32).value().ToHex(), v_["engine32"]);
}

// ---------------------------------------------------------------------------
// Properties.

class ChainHashTest : public ::testing::Test {
 protected:
  static Layout MakeLayout(uint32_t block_tokens = 16) {
    return Layout::Create(LayoutSpec{.model_id = "m", .num_layers = 4, .kv_kind = KvKind::kSeparateKv,
                                     .num_kv_heads = 2, .head_dim = 64, .dtype = DType::kBf16,
                                     .block_tokens = block_tokens, .tp_rank = 0, .tp_size = 1,
                                     .scale_bytes_per_layer = 0})
        .value();
  }
  static std::vector<uint32_t> RandomTokens(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint32_t> t(n);
    for (auto& x : t) x = rng() % 128000;
    return t;
  }

  Layout layout_ = MakeLayout();
  ChainHasher hasher_{Secret::Generate().value(), layout_};
};

TEST_F(ChainHashTest, OnlyFullBlocksGetKeys) {
  EXPECT_EQ(hasher_.ComputeKeys(RandomTokens(15, 1)).value().size(), 0u);
  EXPECT_EQ(hasher_.ComputeKeys(RandomTokens(16, 1)).value().size(), 1u);
  EXPECT_EQ(hasher_.ComputeKeys(RandomTokens(16 * 7 + 5, 1)).value().size(), 7u);
}

TEST_F(ChainHashTest, SamePrefixGivesSameKeys) {
  std::vector<uint32_t> a = RandomTokens(16 * 10, 7);
  std::vector<uint32_t> b(a.begin(), a.begin() + 16 * 6);
  const std::vector<uint32_t> tail = RandomTokens(16 * 3, 8);
  b.insert(b.end(), tail.begin(), tail.end());
  const std::vector<BlockKey> ka = hasher_.ComputeKeys(a).value();
  const std::vector<BlockKey> kb = hasher_.ComputeKeys(b).value();
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(ka[i], kb[i]) << i;
  for (size_t i = 6; i < kb.size(); ++i) EXPECT_NE(ka[i], kb[i]) << i;
  // A second hasher with the same secret (another process) agrees.
  const ChainHasher again(hasher_);
  EXPECT_EQ(again.ComputeKeys(a).value(), ka);
}

TEST_F(ChainHashTest, OneChangedTokenChangesThatBlockAndEveryLaterOne) {
  const std::vector<uint32_t> base = RandomTokens(16 * 8, 3);
  const std::vector<BlockKey> kbase = hasher_.ComputeKeys(base).value();
  for (size_t pos : {0u, 15u, 16u, 50u, 127u}) {
    std::vector<uint32_t> changed = base;
    changed[pos] ^= 1;
    const std::vector<BlockKey> k = hasher_.ComputeKeys(changed).value();
    const size_t block = pos / 16;
    for (size_t i = 0; i < block; ++i) EXPECT_EQ(k[i], kbase[i]) << pos << " " << i;
    for (size_t i = block; i < k.size(); ++i) EXPECT_NE(k[i], kbase[i]) << pos << " " << i;
  }
}

TEST_F(ChainHashTest, ContinuingFromAParentEqualsHashingTheWhole) {
  const std::vector<uint32_t> t = RandomTokens(16 * 6, 4);
  const std::vector<BlockKey> whole = hasher_.ComputeKeys(t).value();
  const std::vector<BlockKey> head = hasher_.ComputeKeys(std::span(t).first(16 * 2)).value();
  const std::vector<BlockKey> rest = hasher_.ComputeKeys(std::span(t).subspan(16 * 2), {}, head.back()).value();
  std::vector<BlockKey> joined = head;
  joined.insert(joined.end(), rest.begin(), rest.end());
  EXPECT_EQ(joined, whole);
  EXPECT_EQ(hasher_.NextKey(hasher_.root(), std::span(t).first(16), {}), whole[0]);
}

TEST_F(ChainHashTest, ExtraKeysChangeTheirBlockAndLaterOnes) {
  const std::vector<uint32_t> t = RandomTokens(16 * 4, 5);
  const std::vector<BlockKey> plain = hasher_.ComputeKeys(t).value();
  const std::vector<ExtraKeys> lora = {{}, {}, {"lora:3"}};
  const std::vector<BlockKey> with = hasher_.ComputeKeys(t, lora).value();
  EXPECT_EQ(with[0], plain[0]);
  EXPECT_EQ(with[1], plain[1]);
  EXPECT_NE(with[2], plain[2]);
  EXPECT_NE(with[3], plain[3]);
  // Boundaries are encoded: {"ab"} differs from {"a", "b"}.
  EXPECT_NE(hasher_.ComputeKeys(t, std::vector<ExtraKeys>{{"ab"}}).value()[0],
            hasher_.ComputeKeys(t, std::vector<ExtraKeys>{{"a", "b"}}).value()[0]);
}

TEST_F(ChainHashTest, DifferentLayoutsOrSecretsGiveDifferentKeys) {
  const std::vector<uint32_t> t = RandomTokens(16 * 2, 6);
  const BlockKey k = hasher_.ComputeKeys(t).value()[0];
  Layout other = Layout::Create([] {
                   LayoutSpec s = MakeLayout().spec();
                   s.dtype = DType::kFp16;
                   return s;
                 }())
                     .value();
  EXPECT_NE(ChainHasher(Secret::Generate().value(), layout_).ComputeKeys(t).value()[0], k);
  EXPECT_NE(ChainHasher(Secret::Generate().value(), other).ComputeKeys(t).value()[0], k);
}

TEST_F(ChainHashTest, RejectsBadInput) {
  const std::vector<uint32_t> t = RandomTokens(16 * 2 + 3, 9);
  // Extra keys may cover the trailing partial block, but not more.
  EXPECT_TRUE(hasher_.ComputeKeys(t, std::vector<ExtraKeys>(3)).has_value());
  Result<std::vector<BlockKey>> too_many = hasher_.ComputeKeys(t, std::vector<ExtraKeys>(4));
  ASSERT_FALSE(too_many.has_value());
  EXPECT_EQ(too_many.error().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(hasher_.ComputeKeys(t, std::vector<ExtraKeys>{ExtraKeys(65, "x")}).has_value());
  EXPECT_FALSE(hasher_.ComputeKeys(t, std::vector<ExtraKeys>{{std::string(4097, 'x')}}).has_value());
  for (size_t n : {0u, 15u, 17u, 31u, 33u, 64u}) {
    std::vector<uint8_t> h(n, 1);
    EXPECT_FALSE(hasher_.KeyFromEngineHash(h).has_value()) << n;
  }
}

TEST_F(ChainHashTest, TenantsGetDisjointStoredKeys) {
  const Secret salt_a = Secret::Generate().value();
  const Secret salt_b = Secret::Generate().value();
  std::set<StoredKey> a_keys;
  std::vector<BlockKey> keys;
  for (uint32_t prompt = 0; prompt < 50; ++prompt) {
    // (Not a range-for over .value() of the temporary: that would dangle.)
    const std::vector<BlockKey> prompt_keys = hasher_.ComputeKeys(RandomTokens(16 * 20, prompt)).value();
    keys.insert(keys.end(), prompt_keys.begin(), prompt_keys.end());
  }
  for (const BlockKey& k : keys) a_keys.insert(DeriveStoredKey(salt_a, layout_.fingerprint(), k));
  EXPECT_EQ(a_keys.size(), keys.size());
  for (const BlockKey& k : keys) {
    EXPECT_EQ(a_keys.count(DeriveStoredKey(salt_b, layout_.fingerprint(), k)), 0u);
    // Same tenant (or sharing group): deterministic.
    EXPECT_EQ(a_keys.count(DeriveStoredKey(salt_a, layout_.fingerprint(), k)), 1u);
  }
  // The namespace is part of the stored key too.
  const Layout other = MakeLayout(32);
  EXPECT_NE(DeriveStoredKey(salt_a, other.fingerprint(), keys[0]),
            DeriveStoredKey(salt_a, layout_.fingerprint(), keys[0]));
}

TEST_F(ChainHashTest, EngineHashes) {
  std::vector<uint8_t> sha(32);
  for (size_t i = 0; i < sha.size(); ++i) sha[i] = static_cast<uint8_t>(i * 7);
  const BlockKey k32 = hasher_.KeyFromEngineHash(sha).value();
  sha[31] ^= 1;  // the last byte matters
  EXPECT_NE(hasher_.KeyFromEngineHash(sha).value(), k32);
  std::vector<uint8_t> h16(sha.begin(), sha.begin() + 16);
  EXPECT_EQ(hasher_.KeyFromEngineHash(h16).value().ToHex(),
            internal::BytesToHex(h16.data(), h16.size()));
}

TEST(Key128Test, HexRoundTripAndErrors) {
  const BlockKey k = BlockKey::FromHex("00112233445566778899AABBCCDDEEFF").value();
  EXPECT_EQ(k.ToHex(), "00112233445566778899aabbccddeeff");
  EXPECT_EQ(k.Low64(), 0x8899aabbccddeeffull);
  EXPECT_FALSE(BlockKey::FromHex("0011").has_value());
  EXPECT_FALSE(BlockKey::FromHex("zz112233445566778899aabbccddeeff").has_value());
}

}  // namespace
}  // namespace kvtier
