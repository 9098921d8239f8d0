// Client::Impl's data path (client_impl.h): registering KV caches (CPU memory
// through memfds, GPU memory through CUDA IPC), chain keys, Lookup, Hint,
// Prefetch, Load and Store (ordered against an engine's CUDA stream through
// the cache's events; by layer), Wait and Cancel, and abandoning an op's copies through
// its fence when its call failed.
#include "client/client_impl.h"

#include <fcntl.h>
#include <poll.h>

#include <cerrno>
#include <climits>

#include "ipc/seqpacket.h"

namespace kvtier {

namespace w = wire;
using client_detail::KeysToWire;
using client_detail::Reply;
using client_detail::TierFromWire;
using flatbuffers::FlatBufferBuilder;

Result<CacheId> Client::Impl::Register(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                                       std::vector<KvRegion> regions, CodecChoice codec) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  auto cache = std::make_unique<Cache>(Cache{.layout = layout, .num_blocks = num_blocks,
                                             .placements = std::move(placements), .codec = codec});
  for (const KvRegion& r : regions) {
    UniqueFd dup(::fcntl(r.memfd, F_DUPFD_CLOEXEC, 0));
    if (!dup) return Err(Status::FromErrno(errno, "dup of a KV cache memfd"));
    cache->fds.push_back(std::move(dup));
    cache->sizes.push_back(r.size_bytes);
  }
  return Add(std::move(cache));
}

Result<CacheId> Client::Impl::RegisterCuda(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                                           std::vector<CudaKvRegion> regions, CodecChoice codec) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(EnsureConnected());
  auto cache = std::make_unique<Cache>(Cache{.layout = layout, .num_blocks = num_blocks,
                                             .placements = std::move(placements), .codec = codec});
  KVTIER_ASSIGN_OR_RETURN(cache->cuda, CudaExport::Create(regions, kEventsPerCache));
  for (const CudaKvRegion& r : regions) cache->sizes.push_back(r.size_bytes);
  return Add(std::move(cache));
}

Result<CacheId> Client::Impl::Add(std::unique_ptr<Cache> cache) {
  KVTIER_RETURN_IF_ERROR(RegisterOne(*cache));
  caches_.push_back(std::move(cache));
  return static_cast<CacheId>(caches_.size());
}

Result<std::vector<BlockKey>> Client::Impl::ComputeKeys(CacheId id, std::span<const uint32_t> tokens,
    std::span<const ExtraKeys> extra, const std::optional<BlockKey>& parent) {
  MutexLock lock(&mu_);
  KVTIER_ASSIGN_OR_RETURN(Cache * c, Find(id));
  return c->hasher->ComputeKeys(tokens, extra, parent);
}

Result<BlockKey> Client::Impl::KeyFromEngineHash(CacheId id, std::span<const uint8_t> hash) {
  MutexLock lock(&mu_);
  KVTIER_ASSIGN_OR_RETURN(Cache * c, Find(id));
  return c->hasher->KeyFromEngineHash(hash);
}

Result<LookupResult> Client::Impl::Lookup(CacheId id, std::span<const BlockKey> keys, double prefill_tokens_per_s) {
  MutexLock lock(&mu_);
  KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
  FlatBufferBuilder b(64 + keys.size() * 16);
  const std::vector<w::Key> wk = KeysToWire(keys);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(
      Reply r, Call(ipc::FinishMessage(b, rid,
                                       w::CreateLookupDirect(b, c->namespace_id, &wk,
                                                             static_cast<float>(prefill_tokens_per_s))),
                    {}, rid, w::Body::LookupReply));
  const w::LookupReply* lr = r.msg->body_as_LookupReply();
  LookupResult out;
  out.hits = lr->hits();
  out.recompute = lr->recompute();
  if (lr->tiers() != nullptr) {
    for (w::Tier t : *lr->tiers()) out.tiers.push_back(TierFromWire(t));
  }
  return out;
}

Result<HintResult> Client::Impl::Hint(CacheId id, std::span<const BlockKey> keys, const BlockHint& hint) {
  if (hint.last_partial) return Err(InvalidArgument("last_partial is a store's hint, not one for cached blocks"));
  if (hint.engine_holds) return Err(InvalidArgument("engine_holds is a store's hint, not one for cached blocks"));
  KVTIER_RETURN_IF_ERROR(ipc::CheckRetentionHint(hint.priority, hint.next_use_ms));
  MutexLock lock(&mu_);
  KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
  FlatBufferBuilder b(64 + keys.size() * 16);
  const std::vector<w::Key> wk = KeysToWire(keys);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(
      Reply r, Call(ipc::FinishMessage(b, rid,
                                       w::CreateHintDirect(b, c->namespace_id, &wk, static_cast<int8_t>(hint.priority),
                                                           hint.next_use_ms, hint.session_over, hint.engine_dropped)),
                    {}, rid, w::Body::HintReply));
  const w::HintReply* hr = r.msg->body_as_HintReply();
  return HintResult{.hinted = hr->hinted(), .refused = hr->refused()};
}

Result<uint32_t> Client::Impl::Prefetch(CacheId id, std::span<const BlockKey> keys, double prefill_tokens_per_s) {
  MutexLock lock(&mu_);
  KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
  FlatBufferBuilder b(64 + keys.size() * 16);
  const std::vector<w::Key> wk = KeysToWire(keys);
  const uint64_t rid = next_id_++;
  KVTIER_ASSIGN_OR_RETURN(
      Reply r, Call(ipc::FinishMessage(b, rid,
                                       w::CreatePrefetchDirect(b, c->namespace_id, &wk,
                                                               static_cast<float>(prefill_tokens_per_s))),
                    {}, rid, w::Body::PrefetchReply));
  return r.msg->body_as_PrefetchReply()->resident();
}

Result<std::variant<OpHandle, OpResult>> Client::Impl::StartOp(
    OpKind kind, bool wait, CacheId id, std::span<const BlockKey> keys,
    std::span<const uint32_t> block_ids, const std::optional<BlockKey>& parent, bool ordered,
    CudaStream stream, const BlockEventInfo* events, const BlockHint* hint) {
  MutexLock lock(&mu_);
  const bool load = kind == OpKind::kLoad || kind == OpKind::kLoadByLayer;
  const bool by_layer = kind == OpKind::kLoadByLayer;
  const bool store_by_layer = kind == OpKind::kStoreByLayer;
  const BlockHint h = hint != nullptr ? *hint : BlockHint{};
  if (h.session_over) return Err(InvalidArgument("session_over is a hint for cached blocks (Hint), not a store's"));
  if (h.engine_dropped) return Err(InvalidArgument("engine_dropped is a hint for cached blocks (Hint), not a store's"));
  if (load && (h.priority != 0 || h.next_use_ms != 0 || h.last_partial)) {
    return Err(InvalidArgument("a load takes engine_holds only (priority, next_use_ms and last_partial are a store's)"));
  }
  KVTIER_RETURN_IF_ERROR(ipc::CheckRetentionHint(h.priority, h.next_use_ms));
  if (keys.size() != block_ids.size()) {
    return Err(InvalidArgument(std::to_string(keys.size()) + " keys but " + std::to_string(block_ids.size()) +
                               " block ids"));
  }
  if (events != nullptr) {
    KVTIER_RETURN_IF_ERROR(ipc::CheckBlockEventSizes({.keys = keys.size(),
                                                      .hash_bytes = events->hash_bytes,
                                                      .hashes = events->engine_hashes.size(),
                                                      .parent = events->parent_hash.size(),
                                                      .tokens = events->token_ids.size(),
                                                      .block_size = events->block_size,
                                                      .lora_name = events->lora_name.size()}));
  }
  KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
  if (by_layer && !layer_progress_) {
    return Err(Status(StatusCode::kUnimplemented,
                      "kvtierd " + daemon_release_ + " does not report a load's layers: load whole (LoadAsync)"));
  }
  if (store_by_layer && !layer_stores_) {
    return Err(Status(StatusCode::kUnimplemented,
                      "kvtierd " + daemon_release_ + " copies stores whole: store whole (StoreAsync)"));
  }
  if (ordered && c->cuda == nullptr) {
    return Err(InvalidArgument("a CUDA stream was given for a cache that is not in GPU memory"));
  }
  // An event slot stays ours until Wait returns the op's result: the
  // engine may wait on a load's OpHandle::event until then, and the daemon
  // watches a store's record until its copies start.
  int32_t event = -1;
  if (ordered) {
    if (std::optional<int32_t> slot = c->cuda->AcquireEvent()) event = *slot;
  }
  auto release = [&] {
    if (event >= 0) c->cuda->ReleaseEvent(event);
    event = -1;
  };
  uint32_t completion = 0;  // the value the store's completion slot gets (the event's slot)
  if (ordered && !load) {
    // The store's copies must read what the engine's stream wrote: they
    // wait for this record, or, with every event busy, for the stream here.
    const Status st = event >= 0 ? c->cuda->Record(event, stream) : c->cuda->Synchronize(stream);
    if (!st.ok()) {
      release();
      return Err(st);
    }
    if (event >= 0) completion = c->cuda->NextCompletionValue(event);
  }
  // From here on, a failure cancels the op's copies (which the daemon
  // may have started) before returning: the caller may reuse the blocks.
  OpFences::Fence fence = fences_->Open(daemon_, by_layer);
  fence.store_by_layer = store_by_layer;
  FlatBufferBuilder b(128 + keys.size() * 20);
  const std::vector<w::Key> wk = KeysToWire(keys);
  const std::vector<uint32_t> ids(block_ids.begin(), block_ids.end());
  const uint64_t rid = next_id_++;
  std::vector<uint8_t> bytes;
  if (load) {
    bytes = ipc::FinishMessage(b, rid,
                               w::CreateLoadDirect(b, c->namespace_id, &wk, &ids, wait, event,
                                                   static_cast<int32_t>(fence.slot), fence.generation, by_layer, h.engine_holds));
  } else {
    const w::Key p = parent ? ipc::ToWire(*parent) : w::Key();
    std::vector<uint8_t> hashes, parent_hash;
    std::vector<uint32_t> tokens;
    std::string lora;
    if (events != nullptr) {
      hashes.assign(events->engine_hashes.begin(), events->engine_hashes.end());
      parent_hash.assign(events->parent_hash.begin(), events->parent_hash.end());
      tokens.assign(events->token_ids.begin(), events->token_ids.end());
      lora = events->lora_name;
    }
    bytes = ipc::FinishMessage(
        b, rid,
        w::CreateStoreDirect(b, c->namespace_id, &wk, &ids, parent ? &p : nullptr, wait, event, event, completion,
                             events != nullptr ? &hashes : nullptr, events != nullptr ? events->hash_bytes : 0,
                             parent_hash.empty() ? nullptr : &parent_hash, tokens.empty() ? nullptr : &tokens,
                             events != nullptr ? events->block_size : 0, lora.empty() ? nullptr : lora.c_str(),
                             static_cast<int8_t>(h.priority), h.next_use_ms, h.last_partial,
                             static_cast<int32_t>(fence.slot), fence.generation, store_by_layer, h.engine_holds));
  }
  if (wait) {
    Result<Reply> r = Call(std::move(bytes), {}, rid, w::Body::OpResult);
    release();  // the op is over (or, on error, never started)
    if (!r) return Err(Abandon(fence, r.error()));
    fences_->Close(fence);
    return FinishOpResult(*r->msg->body_as_OpResult());
  }
  Result<Reply> r = Call(std::move(bytes), {}, rid, w::Body::OpStarted);
  if (!r) {
    release();
    return Err(Abandon(fence, r.error()));
  }
  const w::OpStarted* started = r->msg->body_as_OpStarted();
  OpHandle handle{started->op(), connection_};
  fences_->Track({connection_, handle.op}, fence);
  if (load && event >= 0 && started->event_recorded()) {
    if (Status st = c->cuda->StreamWait(stream, event); !st.ok()) {
      release();
      return Err(st);
    }
    handle.event = c->cuda->event(event);
    handle.event_blocks = started->event_blocks();
  }
  if (!load && event >= 0) {
    // Completes when the daemon writes the value: the store is over.
    Result<CudaEvent> done = c->cuda->CompletionEvent(event, completion);
    if (done) handle.event = *done;  // else no GPU-side completion: Wait
  }
  if (load && handle.event == nullptr) {
    release();  // the daemon never records it for this op
  } else if (event >= 0) {
    op_events_[handle.op] = HeldEvent{c, event, completion};
  }
  return std::variant<OpHandle, OpResult>(handle);
}

Client::Impl::~Impl() {
  MutexLock lock(&mu_);
  std::vector<uint64_t> ops;
  for (const auto& [op, held] : op_events_) ops.push_back(op);
  for (uint64_t op : ops) {
    if (!fd_.valid()) break;
    (void)WaitLocked(OpHandle{op, connection_}, std::chrono::seconds(5));
  }
  // No GPU stream may wait on the fence page once it is gone: end every
  // wait, then wait until the streams have passed theirs.
  MutexLock waits_lock(&layer_waits_mu_);
  if (layer_waits_ != nullptr) {
    fences_->EndLayerWaits();
    layer_waits_.reset();
  }
}

Result<OpResult> Client::Impl::Wait(const OpHandle& op, std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) return Err(InvalidArgument("a Wait's timeout must be >= 0 ms (0: no limit)"));
  MutexLock lock(&mu_);
  return WaitLocked(op, timeout);
}

Result<OpResult> Client::Impl::WaitLocked(const OpHandle& op, std::chrono::milliseconds timeout) {
  if (!fd_.valid() || op.connection != connection_) {
    // Its connection is gone (kvtierd restarted, or a call timed out), and
    // with it the op's result: its copies were cancelled then.
    const OpFences::OpKey key{op.connection, op.op};
    Status lost = Abandon(fences_->Find(key),
                          Unavailable("the connection to kvtierd was lost (it restarted, or a call timed out); "
                                      "the op was lost"));
    if (lost.code() != StatusCode::kAborted) fences_->Untrack(key);
    return Err(std::move(lost));
  }
  FlatBufferBuilder b(64);
  const uint64_t rid = next_id_++;
  const auto ms = static_cast<uint32_t>(std::min<int64_t>(timeout.count(), UINT32_MAX));
  Result<Reply> r = Call(ipc::FinishMessage(b, rid, w::CreateWait(b, op.op, ms)), {}, rid,
                         w::Body::OpResult, std::chrono::milliseconds(ms));
  if (!r) {
    // NotFound: the daemon no longer holds the op, so it is over (its result
    // was taken, or dropped unread after it finished): its event is free.
    if (r.error().code() == StatusCode::kNotFound) {
      ReleaseOpEvent(op.op);
      fences_->Untrack({op.connection, op.op});
    }
    return Err(r.error());
  }
  if (r->msg->body_as_OpResult()->done()) {
    ReleaseOpEvent(op.op);
    fences_->Untrack({op.connection, op.op});
  }
  return ToOpResult(*r->msg->body_as_OpResult());
}

Status Client::Impl::Cancel(const OpHandle& op, std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) return InvalidArgument("a Cancel's timeout must be >= 0 ms (0: no limit)");
  // No lock of the client's calls: this works while one waits on kvtierd.
  const std::optional<OpFences::Fence> fence = fences_->Find({op.connection, op.op});
  if (!fence) return Status::Ok();  // over (its result collected) or cancelled already
  const auto deadline = timeout.count() > 0 ? std::chrono::steady_clock::now() + timeout
                                            : std::chrono::steady_clock::time_point::max();
  if (!fences_->Cancel(*fence, deadline)) {
    return Status(StatusCode::kDeadlineExceeded,
                  "a copy of op " + std::to_string(op.op) + " is still in progress after " +
                      std::to_string(timeout.count()) +
                      " ms (kvtierd stopped or died in the middle of it): its blocks are not safe to reuse yet");
  }
  fences_->Untrack({op.connection, op.op});
  if (fence->store_by_layer && mu_.TryLock()) {
    // Its copies not run yet need not wait for the layers (they find the
    // fence cancelled): the daemon lets go of its host room now rather than
    // at limits.store_layers_timeout_ms. Not while a call holds the
    // connection: this must not wait on kvtierd.
    if (fd_.valid() && op.connection == connection_) (void)SendStoreLayers(op.op, UINT32_MAX);
    mu_.Unlock();
  }
  return Status::Ok();
}

Status Client::Impl::LayersWritten(const OpHandle& op, uint32_t layers) {
  const std::optional<OpFences::Fence> fence = fences_->Find({op.connection, op.op});
  if (!fence) return Status::Ok();  // over (its result collected), or cancelled
  if (!fence->store_by_layer) {
    return InvalidArgument("op " + std::to_string(op.op) + " is not a StoreLayersAsync");
  }
  MutexLock lock(&mu_);
  // A lost connection lost the op with it: the daemon gave it up.
  if (!fd_.valid() || op.connection != connection_) return Status::Ok();
  return SendStoreLayers(op.op, layers);
}

Status Client::Impl::SendStoreLayers(uint64_t op, uint32_t layers) {
  // Never waits on kvtierd (the engine's forward pass calls this): a daemon
  // that has stopped reading gives the store up at its timeout.
  pollfd pfd{.fd = fd_.get(), .events = POLLOUT, .revents = 0};
  if (::poll(&pfd, 1, 0) != 1 || (pfd.revents & POLLOUT) == 0) {
    return Status(StatusCode::kDeadlineExceeded, "kvtierd is not reading its connection: a store's layers not sent");
  }
  FlatBufferBuilder b(64);
  // No reply unless refused, which a later call skips as another's.
  const uint64_t rid = next_id_++;
  if (Status st = ipc::SendMessage(fd_.get(), ipc::FinishMessage(b, rid, w::CreateStoreLayers(b, op, layers)), {});
      !st.ok()) {
    Disconnect();
    return Unavailable("lost kvtierd: " + st.message());
  }
  return Status::Ok();
}

Status Client::Impl::StreamWaitLayers(const OpHandle& op, uint32_t layers, CudaStream stream) {
  if (stream == nullptr) return InvalidArgument("StreamWaitLayers needs a CUDA stream");
  // No lock of the client's calls: the progress word is in shared memory.
  const std::optional<OpFences::Fence> fence = fences_->Find({op.connection, op.op});
  if (!fence) {
    return InvalidArgument("op " + std::to_string(op.op) +
                           " is not running (its result was collected, or it was cancelled)");
  }
  if (!fence->by_layer) return InvalidArgument("op " + std::to_string(op.op) + " is not a LoadLayersAsync");
  MutexLock lock(&layer_waits_mu_);
  if (layer_waits_ == nullptr) {
    KVTIER_ASSIGN_OR_RETURN(layer_waits_, CudaLayerWaits::Create(fences_->progress_words(), FencePage::kSlots));
  }
  return layer_waits_->Wait(stream, fence->slot, OpFences::ProgressTarget(*fence, layers));
}

Result<bool> Client::Impl::WaitLayers(const OpHandle& op, uint32_t layers, std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) return Err(InvalidArgument("a WaitLayers timeout must be >= 0 ms (0: no limit)"));
  // No lock of the client's calls: the progress word is in shared memory.
  const std::optional<OpFences::Fence> fence = fences_->Find({op.connection, op.op});
  if (!fence) return false;  // over (its result collected) or cancelled
  if (!fence->by_layer) return Err(InvalidArgument("op " + std::to_string(op.op) + " is not a LoadLayersAsync"));
  const auto deadline = timeout.count() > 0 ? std::chrono::steady_clock::now() + timeout
                                            : std::chrono::steady_clock::time_point::max();
  switch (fences_->AwaitLayers(*fence, layers, deadline)) {
    case OpFences::LayerWait::kReached: return true;
    case OpFences::LayerWait::kOver: return false;
    case OpFences::LayerWait::kTimedOut: break;
  }
  return Err(Status(StatusCode::kDeadlineExceeded, std::to_string(layers) + " layers of op " + std::to_string(op.op) +
                                                       " are not in place after " + std::to_string(timeout.count()) +
                                                       " ms"));
}

Status Client::Impl::Abandon(std::optional<OpFences::Fence> fence, Status error) {
  if (!fence) return error;
  const auto wait = options_.call_timeout.count() > 0 ? options_.call_timeout
                                                      : std::chrono::milliseconds(std::chrono::seconds(10));
  if (!fences_->Cancel(*fence, std::chrono::steady_clock::now() + wait)) {
    return Status(StatusCode::kAborted,
                  error.message() + "; and a copy of the op is still in progress after " +
                      std::to_string(wait.count()) +
                      " ms (kvtierd stopped or died in the middle of it): its blocks are not safe to reuse");
  }
  fences_->Close(*fence);
  return error;
}

void Client::Impl::ReleaseOpEvent(uint64_t op) {
  auto it = op_events_.find(op);
  if (it == op_events_.end()) return;
  it->second.cache->cuda->ReleaseEvent(it->second.slot);
  op_events_.erase(it);
}

}  // namespace kvtier
