// Client::Impl's connection (client_impl.h): connecting and saying Hello,
// re-registering every cache after a reconnect, dropping the connection, and
// Call: one request, its descriptors, and its reply, within call_timeout.
#include "client/client_impl.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "ipc/seqpacket.h"

namespace kvtier {

namespace w = wire;
using client_detail::Reply;
using flatbuffers::FlatBufferBuilder;

Status Client::Impl::Connect() {
  KVTIER_ASSIGN_OR_RETURN(fences_, OpFences::Create());
  MutexLock lock(&mu_);
  return Reconnect();
}

void Client::Impl::Disconnect() {
  // Ops of this connection are lost, and so are their events' uses. No
  // daemon will write their stores' completions now: write them here, so
  // that no engine stream waits forever.
  for (auto& [op, held] : op_events_) {
    if (held.completion != 0) held.cache->cuda->Complete(held.slot, held.completion);
    held.cache->cuda->ReleaseEvent(held.slot);
  }
  op_events_.clear();
  // Nor will it answer for their copies: none may start now.
  fences_->CancelAll(connection_);
  fd_.Reset();
  next_attempt_ = std::chrono::steady_clock::now() + options_.reconnect_interval;
}

Status Client::Impl::Reconnect() {
  Result<UniqueFd> fd = ipc::Connect(options_.socket_path);
  if (!fd) {
    Disconnect();
    return fd.error();
  }
  fd_ = std::move(*fd);
  ++connection_;
  daemon_ = OpFences::PeerProcess(fd_.get());
  // Large batches (thousands of keys) exceed the default socket buffer;
  // the kernel caps this at net.core.wmem_max, which is fine.
  const int sndbuf = 1 << 20;
  ::setsockopt(fd_.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
  FlatBufferBuilder b(256);
  const uint64_t rid = next_id_++;
  const auto hello = w::CreateHelloDirect(b, ipc::kProtocolVersion,
                                          options_.token.empty() ? nullptr : options_.token.c_str(),
                                          options_.client_name.c_str());
  Result<Reply> r = Call(ipc::FinishMessage(b, rid, hello), {}, rid, w::Body::Welcome);
  if (!r) {
    Disconnect();
    return r.error();
  }
  const w::Welcome* welcome = r->msg->body_as_Welcome();
  std::vector<uint8_t> secret;
  if (welcome->hash_secret() != nullptr) secret.assign(welcome->hash_secret()->begin(), welcome->hash_secret()->end());
  Result<Secret> s = Secret::FromBytes(std::move(secret));
  if (!s) {
    Disconnect();
    return s.error().WithContext("the daemon's hash secret");
  }
  hash_secret_ = std::move(*s);
  tenant_ = welcome->tenant() != nullptr ? welcome->tenant()->str() : "";
  daemon_release_ = welcome->release() != nullptr ? welcome->release()->str() : "";
  layer_progress_ = welcome->layer_progress();
  layer_stores_ = welcome->layer_stores();
  max_keys_per_request_ = std::max<uint32_t>(welcome->max_keys_per_request(), 1);
  for (auto& cache : caches_) {
    if (Status st = RegisterOne(*cache); !st.ok()) {
      Disconnect();
      return st.WithContext("re-registering a KV cache after reconnecting");
    }
  }
  return Status::Ok();
}

Status Client::Impl::RegisterOne(Cache& c) {
  FlatBufferBuilder b(1024);
  std::vector<flatbuffers::Offset<w::MemoryRegion>> regions;
  std::vector<int> fds;
  for (size_t i = 0; i < c.fds.size(); ++i) {
    regions.push_back(w::CreateMemoryRegion(b, w::MemoryKind::HostMemfd, c.sizes[i], static_cast<int>(i)));
    fds.push_back(c.fds[i].get());
  }
  std::vector<w::CudaEventHandle> events;
  if (c.cuda != nullptr) {
    for (const CudaExport::Region& r : c.cuda->regions()) {
      const std::vector<uint8_t> handle(r.handle.begin(), r.handle.end());
      const std::vector<uint8_t> uuid(r.device_uuid.begin(), r.device_uuid.end());
      regions.push_back(w::CreateMemoryRegionDirect(b, w::MemoryKind::CudaIpc, r.size_bytes, -1, &handle, r.offset,
                                                    r.device, &uuid));
    }
    for (const IpcEventHandle& h : c.cuda->event_handles()) {
      events.emplace_back(flatbuffers::span<const uint8_t, 64>(h.data(), h.size()));
    }
  }
  const int completion_index = c.cuda != nullptr ? static_cast<int>(fds.size()) : -1;
  if (c.cuda != nullptr) fds.push_back(c.cuda->completion_fd());
  const auto fence_index = static_cast<int>(fds.size());
  fds.push_back(fences_->fd());
  std::vector<w::Placement> placements;
  for (const Placement& p : c.placements) placements.push_back(ipc::PlacementToWire(p));
  const uint64_t rid = next_id_++;
  const auto body = w::CreateRegisterKvCacheDirect(b, ipc::LayoutToWire(b, c.layout), c.num_blocks, &regions,
                                                   &placements, c.cuda != nullptr ? &events : nullptr,
                                                   completion_index, static_cast<w::Codec>(c.codec.kind),
                                                   c.codec.fp8_group, fence_index);
  KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, body), fds, rid, w::Body::Registered));
  c.namespace_id = r.msg->body_as_Registered()->namespace_id();
  c.hasher = std::make_unique<ChainHasher>(*hash_secret_, c.layout);
  return Status::Ok();
}

Result<Reply> Client::Impl::Call(std::vector<uint8_t> bytes, std::span<const int> fds, uint64_t id,
                                 w::Body expect, std::chrono::milliseconds also) {
  if (Status st = ipc::SendMessage(fd_.get(), bytes, fds); !st.ok()) {
    Disconnect();
    return Err(Unavailable("lost kvtierd: " + st.message()));
  }
  const bool bounded = options_.call_timeout.count() > 0;
  const auto deadline = std::chrono::steady_clock::now() + options_.call_timeout + also;
  while (true) {
    if (bounded) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      pollfd pfd{.fd = fd_.get(), .events = POLLIN, .revents = 0};
      const int ready =
          left.count() > 0
              ? ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)))
              : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) {
        Disconnect();  // a late reply must not be read as the next call's
        return Err(Status(StatusCode::kDeadlineExceeded,
                          "kvtierd did not answer within " +
                              std::to_string((options_.call_timeout + also).count()) +
                              " ms (call_timeout); the connection is dropped"));
      }
    }
    Result<ipc::ReceivedMessage> m = ipc::ReceiveMessage(fd_.get(), ipc::kMaxReplyBytes);
    if (!m || m->eof || m->truncated) {
      Disconnect();
      return Err(Unavailable(!m ? "lost kvtierd: " + m.error().message()
                                : m->eof ? "kvtierd closed the connection" : "oversized reply from kvtierd"));
    }
    Result<const w::Message*> msg = ipc::VerifyMessage(m->bytes);
    if (!msg) {
      Disconnect();
      return Err(msg.error().WithContext("reply from kvtierd"));
    }
    // id 0: the daemon could not read our request (it then closes).
    if ((*msg)->id() != id && (*msg)->id() != 0) continue;  // a late reply to an abandoned call
    if ((*msg)->body_type() == w::Body::Error) {
      const w::Error* e = (*msg)->body_as_Error();
      return Err(ipc::StatusFromWire(e->code(), e->message()));
    }
    if ((*msg)->body_type() != expect) {
      return Err(Internal(std::string("unexpected reply ") + w::EnumNameBody((*msg)->body_type())));
    }
    Reply reply;
    reply.msg = *msg;
    reply.bytes = std::move(m->bytes);  // the heap buffer, and so msg, stay put
    return reply;
  }
}

}  // namespace kvtier
