// The machinery the config's section readers share (config_*.cc): where a
// value came from and the errors found (Context), scalar parsers from a YAML
// node to a value or a message saying what is wrong, and MapReader, which
// reports unknown and duplicate keys. Internal to kvtier_config: who may call
// it is config_loader.cc and the section readers (config_sections.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace kvtier::config_yaml {

// ---------------------------------------------------------------------------
// Where values came from, and the errors found.

class Context {
 public:
  Context(std::string file_name, std::vector<std::pair<std::string, std::string>> overridden)
      : file_name_(std::move(file_name)), overridden_(std::move(overridden)) {}

  // "FILE:LINE", "--set KEY=VALUE" or "defaults".
  std::string Where(const std::string& path, const YAML::Node& node) const {
    // The last override wins, so search from the back.
    for (auto it = overridden_.rbegin(); it != overridden_.rend(); ++it) {
      const std::string& key = it->first;
      // The node itself, something under it, or a map --set created above it.
      const bool under = path.starts_with(key) && (path[key.size()] == '.' || path[key.size()] == '[');
      const bool above = key.starts_with(path + ".");
      if (path == key || under || above) return "--set " + it->second;
    }
    if (node.IsDefined() && node.Mark().line >= 0 && !file_name_.empty()) {
      return file_name_ + ":" + std::to_string(node.Mark().line + 1);
    }
    return file_name_.empty() ? "defaults" : file_name_;
  }

  void Error(const std::string& path, const YAML::Node& node, const std::string& what) {
    if (!locations_.count(path)) Record(path, node);
    errors_.push_back(locations_[path] + ": " + path + ": " + what);
  }
  // At exactly `node` (a duplicate or unknown key).
  void ErrorHere(const std::string& path, const YAML::Node& node, const std::string& what) {
    errors_.push_back(Where(path, node) + ": " + path + ": " + what);
  }
  // For checks across fields, after reading: uses the recorded location.
  void ErrorAt(const std::string& path, const std::string& what) {
    auto it = locations_.find(path);
    const std::string where =
        it != locations_.end() ? it->second : (file_name_.empty() ? "defaults" : file_name_);
    errors_.push_back(where + ": " + path + ": " + what);
  }
  void Record(const std::string& path, const YAML::Node& node) {
    locations_[path] = Where(path, node);
  }
  void Known(const std::string& path) {
    // "tenants[3].name" -> "tenants[].name"
    std::string normalized;
    for (size_t i = 0; i < path.size(); ++i) {
      normalized += path[i];
      if (path[i] == '[') {
        while (i + 1 < path.size() && path[i + 1] != ']') ++i;
      }
    }
    known_.insert(normalized);
  }

  const std::vector<std::string>& errors() const { return errors_; }
  const std::set<std::string>& known() const { return known_; }

 private:
  std::string file_name_;
  std::vector<std::pair<std::string, std::string>> overridden_;  // (dotted key, "key=value")
  std::map<std::string, std::string> locations_;
  std::vector<std::string> errors_;
  std::set<std::string> known_;
};

// ---------------------------------------------------------------------------
// Scalar parsers: YAML node -> value, or a message saying what is wrong
// (yaml_reader.cc).

using ParseResult = std::string;  // empty: OK; otherwise the problem

std::string Describe(const YAML::Node& n);
ParseResult ScalarText(const YAML::Node& n, std::string* out);
ParseResult ParseBoolNode(const YAML::Node& n, bool* out);
ParseResult ParseUint(const YAML::Node& n, uint64_t min, uint64_t max, uint64_t* out);
ParseResult ParseU32(const YAML::Node& n, uint32_t min, uint32_t max, uint32_t* out);
// A positive byte size, in config/size.h's units.
ParseResult ParseSizeNode(const YAML::Node& n, uint64_t* out);
// A fraction in (0, 1].
ParseResult ParseRatio(const YAML::Node& n, double* out);
ParseResult ParseNonEmpty(const YAML::Node& n, std::string* out);
// Names used in file names: tenants and sharing groups.
ParseResult ParseName(const YAML::Node& n, std::string* out);
// Octal, as for chmod: 0660, 660 or 0o660.
ParseResult ParseMode(const YAML::Node& n, uint32_t* out);
// A user or group: a number, or a name the system's databases resolve.
ParseResult ParseUserId(const YAML::Node& n, uint32_t* out);
ParseResult ParseGroupId(const YAML::Node& n, uint32_t* out);
// host:port or [v6]:port; port 0 asks the kernel for a free one (tests).
ParseResult ParseListen(const YAML::Node& n, std::string* out);
// The file's path into *path and its contents, less trailing newlines, into *token.
ParseResult ReadTokenFile(const YAML::Node& n, std::string* path, std::string* token);

template <typename Enum>
ParseResult ParseEnum(const YAML::Node& n, const std::vector<std::pair<std::string, Enum>>& values,
                      Enum* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  std::string names;
  for (const auto& [name, value] : values) {
    if (text == name) {
      *out = value;
      return {};
    }
    names += names.empty() ? name : ", " + name;
  }
  return "expected one of " + names + ", got '" + text + "'";
}

// ---------------------------------------------------------------------------
// MapReader: reads one YAML map, remembering which keys it knows, and reports
// unknown and duplicate keys.

class MapReader {
 public:
  MapReader(Context* ctx, YAML::Node node, std::string path)
      : ctx_(ctx), node_(std::move(node)), path_(std::move(path)) {
    if (node_.IsDefined() && !node_.IsNull() && !node_.IsMap()) {
      ctx_->Error(path_.empty() ? "(top level)" : path_, node_,
                  "expected a map of keys, got " + Describe(node_));
      valid_ = false;
    }
  }

  std::string PathOf(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }

  // The value of `key` (undefined when absent); the key becomes known.
  YAML::Node Take(std::string_view key) {
    known_.emplace_back(key);
    ctx_->Known(PathOf(key));
    if (!valid_ || !node_.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      if (it->first.IsScalar() && it->first.Scalar() == key) {
        ctx_->Record(PathOf(key), it->first);  // the key's line, even for an empty value
        return it->second;
      }
    }
    return YAML::Node(YAML::NodeType::Undefined);
  }

  // Reads `key` with `parse` when present; returns whether it was present
  // (even if invalid). A key with no value is an error, not the default.
  template <typename T, typename Parse>
  bool Read(std::string_view key, T* out, Parse parse) {
    const YAML::Node n = Take(key);
    if (!n.IsDefined()) return false;
    if (n.IsNull()) {
      ctx_->Error(PathOf(key), n, "has no value");
      return true;
    }
    T value = *out;
    if (const ParseResult e = parse(n, &value); !e.empty()) {
      ctx_->Error(PathOf(key), n, e);
    } else {
      *out = std::move(value);
    }
    return true;
  }

  // Reports keys that no Take() asked for, and keys given twice.
  void Finish() {
    if (!valid_ || !node_.IsMap()) return;
    std::set<std::string> seen;
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      const std::string key = it->first.IsScalar() ? it->first.Scalar() : "?";
      const std::string path = PathOf(key);
      if (!seen.insert(key).second) {
        ctx_->ErrorHere(path, it->first, "given more than once");
      } else if (std::find(known_.begin(), known_.end(), key) == known_.end()) {
        std::string known;
        for (const std::string& k : known_) known += known.empty() ? k : ", " + k;
        ctx_->ErrorHere(path, it->first, "unknown key (known here: " + known + ")");
      }
    }
  }

 private:
  Context* ctx_;
  YAML::Node node_;
  std::string path_;
  bool valid_ = true;
  std::vector<std::string> known_;
};

template <typename T, typename ParseItem>
ParseResult ParseList(const YAML::Node& n, std::vector<T>* out, ParseItem parse_item) {
  if (!n.IsSequence()) return "expected a list such as [a, b], got " + Describe(n);
  std::vector<T> items;
  for (size_t i = 0; i < n.size(); ++i) {
    T item{};
    if (auto e = parse_item(n[i], &item); !e.empty()) return "item " + std::to_string(i) + ": " + e;
    items.push_back(std::move(item));
  }
  *out = std::move(items);
  return {};
}

// Adapts a parser of T into a parser of std::optional<T>.
template <typename T, typename Parse>
auto Optional(Parse parse) {
  return [parse](const YAML::Node& n, std::optional<T>* out) -> ParseResult {
    T value{};
    ParseResult e = parse(n, &value);
    if (e.empty()) *out = value;
    return e;
  };
}

}  // namespace kvtier::config_yaml
