// Session: one client connection's state inside the daemon.
//
// Owned by the Server, on the event-loop thread; thread-compatible.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/device_backend.h"
#include "common/memory_mapping.h"
#include "common/unique_fd.h"
#include "daemon/session_ops.h"
#include "common/op_fence.h"
#include "ipc/seqpacket.h"
#include "tiers/block_cache.h"

namespace kvtier {

struct Tenant;

// A KV cache the session registered.
// The page a client registered for store completions (protocol.md, "GPU
// ordering"): kSlots little-endian u32 values the daemon writes.
class CompletionPage {
 public:
  static constexpr size_t kBytes = 4096;
  static constexpr uint32_t kSlots = kBytes / sizeof(uint32_t);
  explicit CompletionPage(MemoryMapping mapping) : mapping_(std::move(mapping)) {}
  // Release: an engine that sees the value sees the stored block's copy done.
  void Write(uint32_t slot, uint32_t value) {
    std::atomic_ref<uint32_t>(reinterpret_cast<uint32_t*>(mapping_.data())[slot]).store(value, std::memory_order_release);
  }

 private:
  MemoryMapping mapping_;
};

struct SessionNamespace {
  std::shared_ptr<const KvCacheLayout> layout;
  std::shared_ptr<ClientMapping> mapping;
  std::shared_ptr<CompletionPage> completions = nullptr;  // optional
  std::shared_ptr<FencePage> fences = nullptr;            // optional: the client's fence page
  // How its blocks are stored below host, and the namespace that makes them
  // (CodedFingerprint): what stored keys are derived with.
  CodecParams codec = {.kind = CodecKind::kNone, .dtype = DType::kBf16, .group_elems = 0};
  LayoutFingerprint fingerprint = {};
};

class CloseList;

struct Session {
  // `max_inflight_ops`: limits.max_inflight_ops_per_session; as many
  // finished results are kept for a later Wait (SessionOps).
  explicit Session(uint32_t max_inflight_ops) : ops(max_inflight_ops, max_inflight_ops) {}
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id = 0;
  UniqueFd fd;
  ipc::PeerCredentials peer;
  Tenant* tenant = nullptr;  // set by Hello
  std::string client_name;
  std::map<uint32_t, SessionNamespace> namespaces;
  uint32_t next_namespace_id = 1;
  // A RegisterKvCache is being mapped off the loop (one at a time).
  bool registering = false;
  SessionOps ops;
  // Replies that did not fit in the socket buffer, sent on EPOLLOUT.
  std::deque<std::vector<uint8_t>> outbox;
  bool want_write = false;
  // In the server's readable_ queue: readable, its next request not read yet.
  bool readable_queued = false;
  // Expires when the session closes: copies finishing later see that their
  // client is gone (stores are discarded).
  std::shared_ptr<void> alive = std::make_shared<int>(0);

  // Why the session must end, once a handler or the loop marked it through
  // the server's CloseList (the loop closes it once the handler has
  // returned, so no handler sees its session destroyed); null while it lives on.
  const char* close_reason() const { return close_reason_; }

 private:
  friend class CloseList;
  const char* close_reason_ = nullptr;
};

}  // namespace kvtier
