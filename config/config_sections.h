// The readers of the config's sections, a file each, called by ReadAll
// (config_loader.cc) only. Each reads its section's keys with their bounds
// and defaults, and reports through the Context what is wrong, checks across
// its own keys included.
#pragma once

#include <vector>

#include "config/config.h"
#include "config/yaml_reader.h"

namespace kvtier::config_yaml {

// tenants: (config_tenants.cc). Absent, one admin tenant for the daemon's own uid.
void ReadTenants(Context* ctx, const YAML::Node& node, std::vector<TenantConfig>* tenants);
// tiers: hbm, host, disk, remote and compression (config_tiers.cc).
void ReadTiers(Context* ctx, const YAML::Node& node, Config::Tiers* tiers);
// policy: watermarks, eviction, hints, writes and disk admission (config_policy.cc).
void ReadPolicy(Context* ctx, const YAML::Node& node, Config::Policy* p);
// events: KV events (config_events.cc).
void ReadEvents(Context* ctx, const YAML::Node& node, Config::Events* e);

}  // namespace kvtier::config_yaml
