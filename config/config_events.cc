// The events: section: KV events for routers (daemon/kv_events*).
#include "config/config_sections.h"

#include <string>

namespace kvtier::config_yaml {
namespace {

// A ZMQ endpoint kvtierd binds: tcp://host:port or ipc://path.
ParseResult ParseZmqEndpoint(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  if (out->starts_with("tcp://")) {
    std::string hostport = out->substr(6);
    return ParseListen(YAML::Node(hostport), &hostport);
  }
  if (out->starts_with("ipc://") && out->size() > 6) return {};
  return "expected tcp://host:port or ipc://path, got '" + *out + "'";
}

}  // namespace

void ReadEvents(Context* ctx, const YAML::Node& node, Config::Events* e) {
  MapReader m(ctx, node, "events");
  m.Read("enabled", &e->enabled, ParseBoolNode);
  m.Read("endpoint", &e->endpoint, ParseZmqEndpoint);
  m.Read("replay_endpoint", &e->replay_endpoint, ParseZmqEndpoint);
  m.Read("topic", &e->topic, [](const YAML::Node& n, std::string* v) -> ParseResult {
    if (auto err = ParseNonEmpty(n, v); !err.empty()) return err;
    for (size_t at = v->find('{'); at != std::string::npos; at = v->find('{', at + 1)) {
      const size_t end = v->find('}', at);
      const std::string name = end == std::string::npos ? v->substr(at) : v->substr(at, end - at + 1);
      if (name != "{node}" && name != "{model}" && name != "{tenant}") {
        return "'" + name + "' is not one of {node}, {model}, {tenant}";
      }
    }
    return {};
  });
  m.Read("node", &e->node, ParseNonEmpty);
  m.Read("encoding", &e->encoding, [](const YAML::Node& n, EventEncoding* v) {
    return ParseEnum<EventEncoding>(n, {{"map", EventEncoding::kMap}, {"positional", EventEncoding::kPositional}}, v);
  });
  m.Read("hash", &e->hashes_as_bytes, [](const YAML::Node& n, bool* v) {
    return ParseEnum<bool>(n, {{"u64", false}, {"bytes", true}}, v);
  });
  m.Read("dp_rank", &e->dp_rank, Optional<int32_t>([](const YAML::Node& n, int32_t* v) -> ParseResult {
    uint32_t u = 0;
    if (auto err = ParseU32(n, 0, 1u << 16, &u); !err.empty()) return err;
    *v = static_cast<int32_t>(u);
    return {};
  }));
  m.Read("cadence_ms", &e->cadence_ms, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 10000, v); });
  m.Read("subscriber_grace_ms", &e->subscriber_grace_ms,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 60000, v); });
  m.Read("max_batch_events", &e->max_batch_events,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 20, v); });
  m.Read("max_queued_events", &e->max_queued_events, [](const YAML::Node& n, uint64_t* v) -> ParseResult {
    uint32_t u = 0;
    if (auto err = ParseU32(n, 1, 1u << 26, &u); !err.empty()) return err;
    *v = u;
    return {};
  });
  m.Read("buffer_batches", &e->buffer_batches, [](const YAML::Node& n, uint64_t* v) -> ParseResult {
    uint32_t u = 0;
    if (auto err = ParseU32(n, 0, 1u << 24, &u); !err.empty()) return err;
    *v = u;
    return {};
  });
  m.Read("buffer_bytes", &e->buffer_bytes, ParseSizeNode);
  m.Read("send_hwm", &e->send_hwm, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 24, v); });
  m.Read("max_metadata_bytes", &e->max_metadata_bytes, ParseSizeNode);
  m.Finish();
  if (!e->replay_endpoint.empty() && e->replay_endpoint == e->endpoint) {
    ctx->ErrorAt("events.replay_endpoint", "must differ from events.endpoint");
  }
}

}  // namespace kvtier::config_yaml
