#include "tools/trace_sim.h"

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <unordered_map>

namespace kvtier::trace {
namespace {

// A cursor over one line of JSON: just enough for the trace's flat objects.
class LineParser {
 public:
  explicit LineParser(std::string_view s) : s_(s) {}

  Result<TraceRequest> Parse() {
    TraceRequest r;
    bool have_hash_ids = false;
    KVTIER_RETURN_IF_ERROR(Expect('{'));
    SkipSpace();
    if (Peek() == '}') return Err(Error("no \"hash_ids\""));
    while (true) {
      KVTIER_ASSIGN_OR_RETURN(std::string key, String());
      KVTIER_RETURN_IF_ERROR(Expect(':'));
      SkipSpace();
      if (key == "hash_ids") {
        KVTIER_ASSIGN_OR_RETURN(r.hash_ids, NumberArray());
        have_hash_ids = true;
      } else if (key == "timestamp") {
        KVTIER_ASSIGN_OR_RETURN(r.timestamp_ms, Number());
      } else if (key == "input_length") {
        KVTIER_ASSIGN_OR_RETURN(r.input_tokens, Number());
      } else if (key == "output_length") {
        KVTIER_ASSIGN_OR_RETURN(r.output_tokens, Number());
      } else {
        KVTIER_RETURN_IF_ERROR(SkipValue());
      }
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        SkipSpace();
        continue;
      }
      KVTIER_RETURN_IF_ERROR(Expect('}'));
      break;
    }
    SkipSpace();
    if (pos_ != s_.size()) return Err(Error("text after the object"));
    if (!have_hash_ids) return Err(Error("no \"hash_ids\""));
    return r;
  }

 private:
  char Peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\r' || s_[pos_] == '\n'))
      ++pos_;
  }
  Status Error(const std::string& what) const {
    return InvalidArgument(what + " at byte " + std::to_string(pos_));
  }
  Status Expect(char c) {
    SkipSpace();
    if (Peek() != c) return Error(std::string("expected '") + c + "'");
    ++pos_;
    return Status::Ok();
  }
  Result<std::string> String() {
    SkipSpace();
    if (Peek() != '"') return Err(Error("expected a string"));
    std::string out;
    for (++pos_; pos_ < s_.size(); ++pos_) {
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c == '\\') {
        // Escapes are kept as written: keys of interest have none.
        if (++pos_ >= s_.size()) break;
        out.push_back('\\');
      }
      out.push_back(s_[pos_]);
    }
    return Err(Error("unterminated string"));
  }
  // A non-negative integer (the trace has no others; a fraction or exponent
  // is refused rather than truncated).
  Result<uint64_t> Number() {
    SkipSpace();
    const size_t start = pos_;
    uint64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const uint64_t digit = static_cast<uint64_t>(s_[pos_] - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - digit) / 10)
        return Err(Error("number out of range"));
      v = v * 10 + digit;
      ++pos_;
    }
    if (pos_ == start) return Err(Error("expected a non-negative integer"));
    if (Peek() == '.' || Peek() == 'e' || Peek() == 'E') return Err(Error("expected an integer"));
    return v;
  }
  Result<std::vector<uint64_t>> NumberArray() {
    KVTIER_RETURN_IF_ERROR(Expect('['));
    std::vector<uint64_t> out;
    SkipSpace();
    if (Peek() == ']') {
      ++pos_;
      return out;
    }
    while (true) {
      KVTIER_ASSIGN_OR_RETURN(uint64_t v, Number());
      out.push_back(v);
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      KVTIER_RETURN_IF_ERROR(Expect(']'));
      return out;
    }
  }
  // A value of a field we do not use: a string, a literal, a number, or an
  // array of such (no nested objects).
  Status SkipValue() {
    SkipSpace();
    const char c = Peek();
    if (c == '"') return String().has_value() ? Status::Ok() : Error("unterminated string");
    if (c == '{') return Error("nested objects are not supported");
    if (c == '[') {
      ++pos_;
      int depth = 1;
      while (pos_ < s_.size() && depth > 0) {
        if (s_[pos_] == '"') {
          if (!String()) return Error("unterminated string");
          continue;
        }
        if (s_[pos_] == '{') return Error("nested objects are not supported");
        depth += s_[pos_] == '[' ? 1 : s_[pos_] == ']' ? -1 : 0;
        ++pos_;
      }
      return depth == 0 ? Status::Ok() : Error("unterminated array");
    }
    const size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] != ',' && s_[pos_] != '}' && s_[pos_] != ' ') ++pos_;
    return pos_ > start ? Status::Ok() : Error("expected a value");
  }

  std::string_view s_;
  size_t pos_ = 0;
};

// The trace with its block ids renumbered densely (0..unique-1), so that the
// simulations index vectors instead of hash maps.
struct DenseTrace {
  std::vector<std::vector<uint32_t>> requests;
  std::vector<const TraceRequest*> source;  // per request
  uint32_t unique = 0;
};

DenseTrace Densify(std::span<const TraceRequest> trace) {
  DenseTrace d;
  std::unordered_map<uint64_t, uint32_t> ids;
  d.requests.reserve(trace.size());
  for (const TraceRequest& r : trace) {
    d.source.push_back(&r);
    std::vector<uint32_t>& out = d.requests.emplace_back();
    out.reserve(r.hash_ids.size());
    for (uint64_t h : r.hash_ids)
      out.push_back(ids.try_emplace(h, static_cast<uint32_t>(ids.size())).first->second);
  }
  d.unique = static_cast<uint32_t>(ids.size());
  return d;
}

// Counts a request's prefix and any hits against `cached`.
template <typename IsCached>
void CountHits(const std::vector<uint32_t>& request, const TraceRequest& source, IsCached cached, SimResult& r) {
  bool prefix = true;
  uint64_t hits = 0;
  for (uint32_t b : request) {
    const bool hit = cached(b);
    prefix = prefix && hit;
    hits += prefix ? 1 : 0;
    r.any_hits += hit ? 1 : 0;
  }
  r.hits += hits;
  r.accesses += request.size();
  r.tokens += source.Tokens();
  r.hit_tokens += source.TokensOf(hits);
  ++r.requests;
}

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

}  // namespace

Result<TraceRequest> ParseTraceLine(std::string_view line) { return LineParser(line).Parse(); }

Result<std::vector<TraceRequest>> ParseTrace(std::string_view text) {
  std::vector<TraceRequest> out;
  size_t line_no = 0;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    auto r = ParseTraceLine(line);
    if (!r)
      return Err(InvalidArgument("line " + std::to_string(line_no) + ": " + r.error().message()));
    out.push_back(std::move(*r));
  }
  std::stable_sort(out.begin(), out.end(), [](const TraceRequest& a, const TraceRequest& b) {
    return a.timestamp_ms < b.timestamp_ms;
  });
  return out;
}

Result<std::vector<TraceRequest>> LoadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Err(Status::FromErrno(errno == 0 ? ENOENT : errno, "open trace " + path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Err(Status::FromErrno(EIO, "read trace " + path));
  auto r = ParseTrace(text.str());
  if (!r) return Err(InvalidArgument(path + ": " + r.error().message()));
  return r;
}

uint64_t DropPartialTails(std::vector<TraceRequest>* trace) {
  uint64_t dropped = 0;
  for (TraceRequest& r : *trace) {
    const uint64_t started = (r.input_tokens + kTraceBlockTokens - 1) / kTraceBlockTokens;
    if (r.input_tokens % kTraceBlockTokens == 0 || r.hash_ids.size() != started) continue;
    r.hash_ids.pop_back();
    ++dropped;
  }
  return dropped;
}

uint64_t CountAccesses(std::span<const TraceRequest> trace) {
  uint64_t n = 0;
  for (const TraceRequest& r : trace) n += r.hash_ids.size();
  return n;
}

uint64_t CountUniqueBlocks(std::span<const TraceRequest> trace) { return Densify(trace).unique; }

SimResult SimulateUnbounded(std::span<const TraceRequest> trace) {
  const DenseTrace d = Densify(trace);
  SimResult r{.capacity_blocks = std::numeric_limits<uint64_t>::max()};
  std::vector<bool> cached(d.unique, false);
  for (size_t n = 0; n < d.requests.size(); ++n) {
    const std::vector<uint32_t>& req = d.requests[n];
    CountHits(
        req, *d.source[n], [&](uint32_t b) { return static_cast<bool>(cached[b]); }, r);
    for (uint32_t b : req) {
      if (!cached[b]) ++r.insertions;
      cached[b] = true;
    }
  }
  return r;
}

SimResult SimulateLru(std::span<const TraceRequest> trace, uint64_t capacity_blocks) {
  const DenseTrace d = Densify(trace);
  SimResult r{.capacity_blocks = capacity_blocks};
  // An intrusive doubly-linked list over the dense ids: head_ = least
  // recently used.
  std::vector<uint32_t> prev(d.unique, kNone), next(d.unique, kNone);
  std::vector<bool> cached(d.unique, false);
  uint32_t head = kNone, tail = kNone;
  uint64_t size = 0;
  auto unlink = [&](uint32_t b) {
    (prev[b] == kNone ? head : next[prev[b]]) = next[b];
    (next[b] == kNone ? tail : prev[next[b]]) = prev[b];
    prev[b] = next[b] = kNone;
  };
  auto push_back = [&](uint32_t b) {
    prev[b] = tail;
    next[b] = kNone;
    (tail == kNone ? head : next[tail]) = b;
    tail = b;
  };
  for (size_t n = 0; n < d.requests.size(); ++n) {
    const std::vector<uint32_t>& req = d.requests[n];
    CountHits(
        req, *d.source[n], [&](uint32_t b) { return static_cast<bool>(cached[b]); }, r);
    if (capacity_blocks == 0) continue;
    for (uint32_t b : req) {
      if (cached[b]) {
        unlink(b);
        push_back(b);
        continue;
      }
      if (size == capacity_blocks) {
        const uint32_t victim = head;
        unlink(victim);
        cached[victim] = false;
        --size;
        ++r.evictions;
      }
      push_back(b);
      cached[b] = true;
      ++size;
      ++r.insertions;
    }
  }
  return r;
}

SimResult SimulateBelady(std::span<const TraceRequest> trace, uint64_t capacity_blocks, uint64_t count_from_request) {
  const DenseTrace d = Densify(trace);
  SimResult r{.capacity_blocks = capacity_blocks};
  constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
  // next_ref[i]: the index in the reference string of the next reference to
  // the block of reference i.
  uint64_t refs = 0;
  for (const auto& req : d.requests) refs += req.size();
  std::vector<uint64_t> next_ref(refs);
  {
    std::vector<uint64_t> seen_at(d.unique, kNever);
    uint64_t i = refs;
    for (auto req = d.requests.rbegin(); req != d.requests.rend(); ++req) {
      for (auto b = req->rbegin(); b != req->rend(); ++b) {
        --i;
        next_ref[i] = seen_at[*b];
        seen_at[*b] = i;
      }
    }
  }
  // cached_next[b]: the next reference of cached block b (kNone-like
  // sentinel kUncached when not cached). The heap holds (next reference,
  // block) with stale entries skipped lazily.
  constexpr uint64_t kUncached = kNever - 1;  // never a reference index (refs < 2^63)
  std::vector<uint64_t> cached_next(d.unique, kUncached);
  using Entry = std::pair<uint64_t, uint32_t>;  // farthest first
  std::priority_queue<Entry> farthest;
  uint64_t size = 0;
  auto is_cached = [&](uint32_t b) { return cached_next[b] != kUncached; };
  auto settle = [&] {
    while (cached_next[farthest.top().second] != farthest.top().first) farthest.pop();
  };
  uint64_t i = 0;
  SimResult warming;  // the hits of the requests before count_from_request
  for (uint64_t n = 0; n < d.requests.size(); ++n) {
    const std::vector<uint32_t>& req = d.requests[n];
    CountHits(req, *d.source[n], is_cached, n < count_from_request ? warming : r);
    for (uint32_t b : req) {
      const uint64_t nr = next_ref[i++];
      if (capacity_blocks == 0) continue;
      if (is_cached(b)) {
        cached_next[b] = nr;
        farthest.emplace(nr, b);
        continue;
      }
      if (size == capacity_blocks) {
        settle();
        if (farthest.top().first <= nr)
          continue;  // bypass: b is needed no sooner than any cached block
        cached_next[farthest.top().second] = kUncached;
        farthest.pop();
        --size;
        ++r.evictions;
      }
      cached_next[b] = nr;
      farthest.emplace(nr, b);
      ++size;
      ++r.insertions;
    }
  }
  return r;
}

}  // namespace kvtier::trace
