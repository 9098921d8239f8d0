#include "config/size.h"

#include <array>
#include <cctype>
#include <utility>

namespace kvtier {
namespace {

struct Unit {
  std::string_view name;
  uint64_t multiplier;
};

constexpr std::array<Unit, 14> kUnits = {{
    {"B", 1},
    {"K", 1ull << 10}, {"KiB", 1ull << 10}, {"KB", 1000ull},
    {"M", 1ull << 20}, {"MiB", 1ull << 20}, {"MB", 1000ull * 1000},
    {"G", 1ull << 30}, {"GiB", 1ull << 30}, {"GB", 1000ull * 1000 * 1000},
    {"T", 1ull << 40}, {"TiB", 1ull << 40}, {"TB", 1000ull * 1000 * 1000 * 1000},
    {"", 1},
}};

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

Result<uint64_t> ParseSize(std::string_view text) {
  const std::string_view s = Trim(text);
  auto bad = [&](std::string_view why) {
    return Err(InvalidArgument("'" + std::string(text) + "' is not a size (" + std::string(why) +
                               "); write e.g. 4096, 512MiB or 64GiB"));
  };
  size_t digits = 0;
  uint64_t value = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) {
    if (__builtin_mul_overflow(value, 10u, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(s[digits] - '0'), &value)) {
      return bad("too large");
    }
    ++digits;
  }
  if (digits == 0) return bad(s.starts_with('-') ? "negative" : "no number");
  const std::string_view unit = Trim(s.substr(digits));
  for (const Unit& u : kUnits) {
    if (unit == u.name) {
      uint64_t bytes = 0;
      if (__builtin_mul_overflow(value, u.multiplier, &bytes)) return bad("too large");
      return bytes;
    }
  }
  return bad("unknown unit '" + std::string(unit) + "'");
}

std::string FormatSize(uint64_t size_bytes) {
  // The unit that gives the smallest whole number: 64GiB, 20TB, 4097B.
  std::string_view best_name = "B";
  uint64_t best = size_bytes;
  for (const Unit& u : kUnits) {
    if (u.name.size() < 2 || size_bytes == 0 || size_bytes % u.multiplier != 0) continue;
    if (size_bytes / u.multiplier < best) {
      best = size_bytes / u.multiplier;
      best_name = u.name;
    }
  }
  return std::to_string(best) + std::string(best_name);
}

}  // namespace kvtier
