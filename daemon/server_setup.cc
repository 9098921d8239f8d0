// Server's tiers and devices at start-up (Server::Setup calls these): the
// remote tier, KV events, the disk tier and the device backend. Kept apart
// from server.cc, which holds the event loop.
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>

#include <spdlog/spdlog.h>

#include "daemon/server.h"
#include "config/size.h"
#include "devices/host_backend.h"
#include "tiers/codec_pool.h"
#include "tiers/disk/file_device.h"
#if KVTIER_HAVE_CUDA
#include "devices/cuda_backend.h"
#endif

namespace kvtier {

Status Server::SetupRemote() {
  const Config::Tiers::Remote& r = options_.config.tiers.remote;
  RemoteTierOptions o;
  for (const std::string& seed : r.seeds) {
    KVTIER_ASSIGN_OR_RETURN(NodeAddress a, ParseNodeAddress(seed));
    o.cluster.seeds.push_back(std::move(a));
  }
  o.cluster.user = r.user;
  if (!r.password_file.empty()) {
    std::ifstream in(r.password_file);
    if (!in || !std::getline(in, o.cluster.password) || o.cluster.password.empty()) {
      return InvalidArgument("tiers.remote.password_file: cannot read a password from " + r.password_file);
    }
  }
  o.cluster.connect_timeout = std::chrono::milliseconds(r.connect_timeout_ms);
  o.cluster.io_timeout = std::chrono::milliseconds(r.timeout_ms);
  o.key_prefix = r.key_prefix;
  o.io_threads = r.io_threads;
  o.max_inflight_batches = r.max_inflight_batches;
  o.max_value_bytes = r.max_value_bytes;
  o.breaker_failures = r.breaker_failures;
  o.breaker_cooldown = std::chrono::milliseconds(r.breaker_cooldown_ms);
  o.post = [this](std::function<void()> fn) { Post(std::move(fn), "remote tier"); };
  KVTIER_ASSIGN_OR_RETURN(remote_, RemoteTier::Start(std::move(o)));
  spdlog::info("remote tier: {} seed node(s), key prefix '{}', {} I/O thread(s) (the cluster is reached on first "
               "use)",
               r.seeds.size(), r.key_prefix, r.io_threads);
  return Status::Ok();
}

Status Server::SetupEvents() {
  const Config::Events& e = options_.config.events;
  std::string node = e.node;
  if (node.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) return Status::FromErrno(errno, "gethostname");
    node = host;
  }
  std::vector<KvEventSource::TenantTopic> topics;
  for (const auto& t : tenants_->tenants()) {
    KVTIER_CHECK(t->id == topics.size());
    std::string topic = e.topic;
    auto fill = [&](std::string_view name, std::string_view value) {
      for (size_t at = topic.find(name); at != std::string::npos; at = topic.find(name, at + value.size())) {
        topic.replace(at, name.size(), value);
      }
    };
    fill("{node}", node);
    fill("{model}", t->config.model.empty() ? t->config.name : t->config.model);
    fill("{tenant}", t->config.name);
    topics.push_back({.publish = t->config.publish_events, .topic = std::move(topic)});
  }
  KVTIER_ASSIGN_OR_RETURN(
      std::unique_ptr<KvEventPublisher> publisher,
      KvEventPublisher::Start({.endpoint = e.endpoint,
                               .replay_endpoint = e.replay_endpoint,
                               .encoding = {.positional = e.encoding == EventEncoding::kPositional,
                                            .hashes_as_bytes = e.hashes_as_bytes},
                               .dp_rank = e.dp_rank,
                               .cadence = std::chrono::milliseconds(e.cadence_ms),
                               .max_batch_events = e.max_batch_events,
                               .max_queued_events = e.max_queued_events,
                               .buffer_batches = e.buffer_batches,
                               .buffer_bytes = e.buffer_bytes,
                               .send_high_water_mark = static_cast<int>(e.send_hwm),
                               .subscriber_grace = std::chrono::milliseconds(e.subscriber_grace_ms)}));
  size_t publishing = 0;
  for (const auto& t : topics) publishing += t.publish ? 1 : 0;
  spdlog::info("KV events on {} (replay: {}), {} of {} tenant(s) published", e.endpoint,
               e.replay_endpoint.empty() ? "off" : e.replay_endpoint, publishing, topics.size());
  events_ = std::make_unique<KvEventSource>(std::move(publisher), std::move(topics), e.max_metadata_bytes);
  return Status::Ok();
}

Status Server::SetupDisk() {
  const Config::Tiers::Disk& d = options_.config.tiers.disk;
  KVTIER_ASSIGN_OR_RETURN(io_engine_, IoEngine::Create({.kind = d.io_engine,
                                                       .threads = d.io_threads,
                                                       .queue_depth = d.queue_depth}));
  spdlog::info("disk I/O: {} ({} thread(s), queue depth {})", io_engine_->name(), d.io_threads, d.queue_depth);
  if (d.io_engine == IoEngineKind::kAuto && std::string_view(io_engine_->name()) != "io_uring") {
    spdlog::warn("disk I/O: io_uring is not available here (kernel or seccomp); using the thread pool");
  }
  std::vector<BlockDevice*> devices;
  for (const std::string& path : d.paths) {
    KVTIER_RETURN_IF_ERROR(undo_.CreateDirectories(path).WithContext("tiers.disk.paths"));
    const std::string segment = path + "/segment-0.kvt";
    Result<std::unique_ptr<FileDevice>> dev = FileDevice::Open({.path = segment,
                                                                .size_bytes = d.bytes,
                                                                .direct_io = d.direct_io,
                                                                .engine = io_engine_.get()});
    if (!dev) {
      // Too large for its file system: the key to change is the size.
      return dev.error().WithContext(dev.error().code() == StatusCode::kResourceExhausted
                                         ? "tiers.disk.bytes: " + FormatSize(d.bytes) + " per path"
                                         : "tiers.disk.paths: " + path);
    }
    if ((*dev)->created()) undo_.AddFile(segment);
    devices.push_back(dev->get());
    disk_devices_.push_back(std::move(*dev));
  }
  // A new index goes with a failed start-up; an existing one holds the warm
  // cache and stays.
  const std::string index_path = options_.config.state_dir + "/disk-index";
  KVTIER_RETURN_IF_ERROR(
      undo_.CreateDirectories(index_path, /*whole=*/true).WithContext("state_dir"));
  KVTIER_ASSIGN_OR_RETURN(
      disk_,
      DiskTier::Open({.devices = devices,
                      .index_path = index_path,
                      .region_bytes = d.region_bytes,
                      .post = [this](std::function<void()> fn) { Post(std::move(fn), "disk tier"); },
                      .reclaim =
                          [this](const StoredKey& key, const DiskLocation& where, bool may_carry) {
                            return cache_->ReclaimFromDisk(key, where, may_carry);
                          },
                      .relocated =
                          [this](const StoredKey& key, Result<DiskLocation> now) {
                            return cache_->FinishRelocation(key, std::move(now));
                          },
                      .high_watermark = options_.config.policy.watermarks.disk.high,
                      .low_watermark = options_.config.policy.watermarks.disk.low}));
  return Status::Ok();
}

Status Server::SetupBackend() {
  const Config& c = options_.config;
  // LoadConfig refused more than one hbm device, and cuda in a build without
  // it (config/startup_rules.h), so that --check-config refuses them too.
  const std::vector<uint32_t>& hbm_devices = c.tiers.hbm.devices;
  hbm_device_ = hbm_devices.empty() ? 0 : static_cast<int>(hbm_devices.front());
  if (options_.backend) {
    backend_ = std::move(options_.backend);
    return Status::Ok();
  }
  if (c.device.backend != DeviceBackendKind::kHost) {
#if KVTIER_HAVE_CUDA
    Result<std::unique_ptr<CudaBackend>> cuda = CudaBackend::Create({});
    if (cuda) {
      if (hbm_devices.empty()) hbm_device_ = (*cuda)->devices().front();
      backend_ = std::move(*cuda);
      return Status::Ok();
    }
    if (c.device.backend == DeviceBackendKind::kCuda) return cuda.error().WithContext("device.backend: cuda");
    spdlog::info("device backend: no usable GPU ({}); using host", cuda.error().ToString());
#endif
  }
  const uint32_t threads = std::max(2u, std::thread::hardware_concurrency() / 2);
  KVTIER_ASSIGN_OR_RETURN(backend_, HostBackend::Create({.copy_threads = threads,
                                                         .populate_host = c.tiers.host.prefault}));
  return Status::Ok();
}

}  // namespace kvtier
