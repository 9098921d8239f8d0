// Little-endian integers appended to, and consumed from, a byte string:
// the encodings of the disk index's values and of the KV-event annotation
// (docs/disk-format.md). Explicit byte-by-byte, so the formats do not depend
// on the host's byte order.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvtier::le {

template <typename T>
void Put(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

// Takes a T off the front of `in`; false (nothing taken) when it is shorter.
template <typename T>
bool Get(std::string_view& in, T* v) {
  if (in.size() < sizeof(T)) return false;
  *v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) *v |= static_cast<T>(static_cast<uint8_t>(in[i])) << (8 * i);
  in.remove_prefix(sizeof(T));
  return true;
}

}  // namespace kvtier::le
