// Server::Handle: the one entry of every request. It checks the session may
// send it (Hello first), times it, and hands it to its message family's
// handler, each of which validates every count, index and length it reads
// from the (already verified) message before use, and answers with a reply
// or an Error; a handler that returns no bytes has deferred its reply. The
// families, a file each:
//   handlers_session.cc  Hello, RegisterKvCache (mapped off the loop)
//   handlers_data.cc     Hint, Lookup, Prefetch, Load, Store, Wait, Poll, Cancel
//   handlers_admin.cc    Stats, Evict, ListNamespaces, VerifyDisk, ListTenants,
//                        and the metrics snapshot
#include <spdlog/spdlog.h>

#include "daemon/server.h"

namespace kvtier {

namespace w = wire;
using flatbuffers::FlatBufferBuilder;

void Server::Handle(Session& s, const w::Message& msg, std::vector<UniqueFd> fds) {
  const uint64_t id = msg.id();
  if (s.tenant == nullptr && msg.body_type() != w::Body::Hello) {
    Send(s, ipc::ErrorMessage(id, Status(StatusCode::kUnauthenticated, "send Hello first")));
    MarkClosing(s, "request before Hello");
    return;
  }
  if (!fds.empty() && msg.body_type() != w::Body::RegisterKvCache) {
    // The descriptors are closed when `fds` goes; the request itself is fine.
    spdlog::debug("session {}: ignoring {} descriptor(s) sent with a {}", s.id, fds.size(),
                  w::EnumNameBody(msg.body_type()));
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<uint8_t> reply;
  switch (msg.body_type()) {
    case w::Body::Hello:
      reply = HandleHello(s, id, *msg.body_as_Hello());
      break;
    case w::Body::RegisterKvCache:
      reply = HandleRegister(s, id, *msg.body_as_RegisterKvCache(), std::move(fds));
      break;
    case w::Body::Lookup:
      reply = HandleLookup(s, id, *msg.body_as_Lookup());
      break;
    case w::Body::Prefetch:
      reply = HandlePrefetch(s, id, *msg.body_as_Prefetch());
      break;
    case w::Body::Hint:
      reply = HandleHint(s, id, *msg.body_as_Hint());
      break;
    case w::Body::Load:
      reply = HandleLoadOrStore(s, id, true, msg.body_as_Load(), nullptr);
      break;
    case w::Body::Store:
      reply = HandleLoadOrStore(s, id, false, nullptr, msg.body_as_Store());
      break;
    case w::Body::StoreLayers:
      reply = HandleStoreLayers(s, id, *msg.body_as_StoreLayers());
      break;
    case w::Body::Wait:
      reply = HandleWaitOrPoll(s, id, msg.body_as_Wait()->op(), msg.body_as_Wait()->timeout_ms());
      break;
    case w::Body::Poll:
      reply = HandleWaitOrPoll(s, id, msg.body_as_Poll()->op(), std::nullopt);
      break;
    case w::Body::Stats:
      reply = HandleStats(s, id);
      break;
    case w::Body::Evict:
      reply = HandleEvict(s, id, *msg.body_as_Evict());
      break;
    case w::Body::Flush:
      if (!s.tenant->config.admin) {
        reply = ipc::ErrorMessage(id, Status(StatusCode::kPermissionDenied, "flush is an admin call"));
      } else if (!disk_) {
        reply = ipc::ErrorMessage(id, Status(StatusCode::kFailedPrecondition, "flush: there is no disk tier"));
      } else {
        FlatBufferBuilder b(64);
        reply = ipc::FinishMessage(b, id, w::CreateFlushReply(b, cache_->FlushToDisk()));
      }
      break;
    case w::Body::ListTenants:
      reply = HandleListTenants(s, id);
      break;
    case w::Body::ListNamespaces:
      reply = HandleListNamespaces(s, id, *msg.body_as_ListNamespaces());
      break;
    case w::Body::VerifyDisk:
      reply = HandleVerify(s, id, *msg.body_as_VerifyDisk());
      break;
    default:
      ++messages_rejected_;
      reply = ipc::ErrorMessage(id, InvalidArgument(std::string("not a request: ") +
                                                    w::EnumNameBody(msg.body_type())));
      break;
  }
  Send(s, std::move(reply));
  turn_.Add(w::EnumNameBody(msg.body_type()), std::chrono::steady_clock::now() - start);
}

}  // namespace kvtier
