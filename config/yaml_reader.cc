#include "config/yaml_reader.h"

#include <grp.h>
#include <pwd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>

#include "config/size.h"

namespace kvtier::config_yaml {
namespace {

// A numeric id, or a name that `lookup` resolves (nullopt: no such name).
template <typename Lookup>
ParseResult ParseIdOrName(const YAML::Node& n, uint32_t* out, const char* what, Lookup lookup) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  uint32_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc() && end == text.data() + text.size() && !text.empty()) {
    *out = v;
    return {};
  }
  const std::optional<uint32_t> id = lookup(text);
  if (!id) return std::string("no ") + what + " named '" + text + "' (give a name or a number)";
  *out = *id;
  return {};
}

}  // namespace

std::string Describe(const YAML::Node& n) {
  if (n.IsMap()) return "a map";
  if (n.IsSequence()) return "a list";
  if (n.IsNull()) return "nothing";
  return "'" + n.Scalar() + "'";
}

ParseResult ScalarText(const YAML::Node& n, std::string* out) {
  if (!n.IsScalar()) return "expected a value, got " + Describe(n);
  *out = n.Scalar();
  return {};
}

ParseResult ParseBoolNode(const YAML::Node& n, bool* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  if (!YAML::convert<bool>::decode(n, *out)) return "expected true or false, got '" + text + "'";
  return {};
}

ParseResult ParseUint(const YAML::Node& n, uint64_t min, uint64_t max, uint64_t* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    return "expected a whole number from " + std::to_string(min) + " to " + std::to_string(max) +
           ", got '" + text + "'";
  }
  if (v < min || v > max) {
    return "must be from " + std::to_string(min) + " to " + std::to_string(max) + ", got " + text;
  }
  *out = v;
  return {};
}

ParseResult ParseU32(const YAML::Node& n, uint32_t min, uint32_t max, uint32_t* out) {
  uint64_t v = 0;
  if (auto e = ParseUint(n, min, max, &v); !e.empty()) return e;
  *out = static_cast<uint32_t>(v);
  return {};
}

// A positive byte size.
ParseResult ParseSizeNode(const YAML::Node& n, uint64_t* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  Result<uint64_t> size = ParseSize(text);
  if (!size) return size.error().message();
  if (*size == 0) return "must be a positive size, got '" + text + "'";
  *out = *size;
  return {};
}

ParseResult ParseRatio(const YAML::Node& n, double* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty() || !(v > 0 && v <= 1)) {
    return "expected a fraction in (0, 1], got '" + text + "'";
  }
  *out = v;
  return {};
}

ParseResult ParseNonEmpty(const YAML::Node& n, std::string* out) {
  if (auto e = ScalarText(n, out); !e.empty()) return e;
  if (out->empty()) return "must not be empty";
  return {};
}

// Names used in file names: tenants and sharing groups.
ParseResult ParseName(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  const bool ok = out->size() <= 64 && std::all_of(out->begin(), out->end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                           (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
                  }) && out->front() != '.';
  if (!ok) return "'" + *out + "' must be 1-64 of A-Z a-z 0-9 _ - . and not start with '.'";
  return {};
}

// Octal, as for chmod: 0660, 660 or 0o660.
ParseResult ParseMode(const YAML::Node& n, uint32_t* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  std::string_view digits = text;
  if (digits.starts_with("0o")) digits.remove_prefix(2);
  uint32_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v, 8);
  if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty() || v > 0777) {
    return "expected an octal mode such as 0660, got '" + text + "'";
  }
  if ((v & 0600) != 0600) return "the owner needs read and write permission (0600), got '" + text + "'";
  *out = v;
  return {};
}

ParseResult ParseUserId(const YAML::Node& n, uint32_t* out) {
  return ParseIdOrName(n, out, "user", [](const std::string& name) -> std::optional<uint32_t> {
    struct passwd pw {};
    struct passwd* found = nullptr;
    std::vector<char> buf(16384);
    if (getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) return {};
    return found->pw_uid;
  });
}

ParseResult ParseGroupId(const YAML::Node& n, uint32_t* out) {
  return ParseIdOrName(n, out, "group", [](const std::string& name) -> std::optional<uint32_t> {
    struct group gr {};
    struct group* found = nullptr;
    std::vector<char> buf(65536);
    if (getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) return {};
    return found->gr_gid;
  });
}

// host:port or [v6]:port; port 0 asks the kernel for a free one (tests).
ParseResult ParseListen(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  const size_t colon = out->rfind(':');
  const std::string_view host = colon == std::string::npos ? "" : std::string_view(*out).substr(0, colon);
  uint32_t port = 0;
  const std::string_view port_text =
      colon == std::string::npos ? "" : std::string_view(*out).substr(colon + 1);
  const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (host.empty() || ec != std::errc() || end != port_text.data() + port_text.size() ||
      port > 65535) {
    return "expected host:port such as 127.0.0.1:9464 or [::1]:9464, got '" + *out + "'";
  }
  return {};
}

ParseResult ReadTokenFile(const YAML::Node& n, std::string* path, std::string* token) {
  if (auto e = ParseNonEmpty(n, path); !e.empty()) return e;
  std::ifstream in(*path, std::ios::binary);
  if (!in) return "cannot read token file '" + *path + "': " + std::strerror(errno);
  std::stringstream ss;
  ss << in.rdbuf();
  *token = ss.str();
  while (!token->empty() && (token->back() == '\n' || token->back() == '\r')) token->pop_back();
  return {};
}

}  // namespace kvtier::config_yaml
