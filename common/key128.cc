#include "common/key128.h"

namespace kvtier::internal {
namespace {
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

std::string BytesToHex(const uint8_t* data, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(size * 2, '0');
  for (size_t i = 0; i < size; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 0xf];
  }
  return out;
}

Status HexToBytes(std::string_view hex, uint8_t* out, size_t size) {
  if (hex.size() != size * 2) {
    return InvalidArgument("expected " + std::to_string(size * 2) + " hex digits, got " +
                           std::to_string(hex.size()));
  }
  for (size_t i = 0; i < size; ++i) {
    const int hi = HexValue(hex[2 * i]);
    const int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgument("not a hex digit in '" + std::string(hex) + "'");
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return Status::Ok();
}

}  // namespace kvtier::internal
