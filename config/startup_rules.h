// Startup rules: what kvtierd's start-up would refuse from the config alone,
// beyond each key's own bounds (those are the loader's): rules of this
// version (one hbm device per daemon), of this build (the cuda backend needs
// a CUDA build) and of the disk format (4 KiB-aligned sizes, region offsets
// in 32 bits of 4 KiB). LoadConfig runs them, so `kvtierd --check-config`
// refuses everything that start-up would refuse without looking at a file
// system or a device.
//
// Internal to kvtier_config. Thread-safe (pure).
#pragma once

#include <functional>
#include <string>

#include "config/config.h"

namespace kvtier {

// Reports each broken rule as error(key, what), `key` being the dotted key
// that is wrong (the loader prefixes where it was set).
void CheckStartupRules(
    const Config& config,
    const std::function<void(const std::string& key, const std::string& what)>& error);

}  // namespace kvtier
