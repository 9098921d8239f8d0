// The policy: section: watermarks, eviction, retention hints, writes and
// disk admission.
#include "config/config_sections.h"

#include <cstdio>
#include <string>

namespace kvtier::config_yaml {
namespace {

void ReadWatermarks(Context* ctx, const YAML::Node& node, const std::string& path, Watermarks* w) {
  MapReader r(ctx, node, path);
  r.Read("high", &w->high, ParseRatio);
  r.Read("low", &w->low, ParseRatio);
  r.Finish();
  if (w->low >= w->high) {
    char high[32];
    std::snprintf(high, sizeof(high), "%g", w->high);
    ctx->ErrorAt(path + ".low", "must be below " + path + ".high (" + high + ")");
  }
}

}  // namespace

void ReadPolicy(Context* ctx, const YAML::Node& node, Config::Policy* p) {
  MapReader r(ctx, node, "policy");
  {
    MapReader w(ctx, r.Take("watermarks"), "policy.watermarks");
    ReadWatermarks(ctx, w.Take("hbm"), "policy.watermarks.hbm", &p->watermarks.hbm);
    ReadWatermarks(ctx, w.Take("host"), "policy.watermarks.host", &p->watermarks.host);
    ReadWatermarks(ctx, w.Take("disk"), "policy.watermarks.disk", &p->watermarks.disk);
    w.Finish();
  }
  r.Read("eviction", &p->eviction, [](const YAML::Node& n, EvictionKind* v) {
    return ParseEnum<EvictionKind>(
        n, {{"lru", EvictionKind::kLru}, {"s3fifo", EvictionKind::kS3Fifo}, {"classes", EvictionKind::kClasses}}, v);
  });
  {
    MapReader h(ctx, r.Take("hints"), "policy.hints");
    h.Read("max_share", &p->hints.max_share, ParseRatio);
    h.Finish();
  }
  r.Read("prefix_aware", &p->prefix_aware, ParseBoolNode);
  r.Read("write_policy", &p->write_policy, [](const YAML::Node& n, WritePolicy* v) {
    return ParseEnum<WritePolicy>(
        n, {{"write_back", WritePolicy::kWriteBack}, {"write_through", WritePolicy::kWriteThrough}}, v);
  });
  // Hit counts saturate at 511 (DiskOnlyBlock::kMaxHits): more could never be met.
  r.Read("disk_promotion_min_hits", &p->disk_promotion_min_hits,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 511, v); });
  {
    MapReader a(ctx, r.Take("disk_admission"), "policy.disk_admission");
    a.Read("min_hits", &p->disk_admission.min_hits,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 511, v); });
    a.Read("reuse", &p->disk_admission.reuse, ParseBoolNode);
    a.Read("learned", &p->disk_admission.learned, ParseBoolNode);
    a.Read("write_budget_per_day", &p->disk_admission.write_budget_bytes_per_day,
           [](const YAML::Node& n, std::optional<uint64_t>* v) -> ParseResult {
             if (n.IsScalar() && n.Scalar() == "unlimited") {
               v->reset();
               return {};
             }
             uint64_t bytes = 0;
             if (auto e = ParseSizeNode(n, &bytes); !e.empty()) return e + " (or 'unlimited')";
             *v = bytes;
             return {};
           });
    a.Finish();
  }
  r.Finish();
}

}  // namespace kvtier::config_yaml
