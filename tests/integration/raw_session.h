// RawSession: a protocol session over a raw socket, for tests that send what
// the client library never would (malformed messages, requests pipelined
// without waiting for their replies).
//
// Thread-compatible; for tests only.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "ipc/seqpacket.h"
#include "ipc/wire.h"

namespace kvtier::testing {

class RawSession {
 public:
  explicit RawSession(const std::string& path) : fd_(ipc::Connect(path).value()) {}
  Status Send(std::span<const uint8_t> bytes, std::span<const int> fds = {}) {
    return ipc::SendMessage(fd_.get(), bytes, fds);
  }
  // The next reply: its body type and, for an Error, the code; or eof.
  struct Reply {
    bool eof = false;
    wire::Body body = wire::Body::NONE;
    uint64_t id = 0;  // the request's
    StatusCode code = StatusCode::kOk;
    std::string message;
    bool event_recorded = false;  // OpStarted
    uint64_t op = 0;              // OpStarted, OpResult
    bool done = false;            // OpResult
    std::vector<uint8_t> bytes;   // the whole message, for what the fields above leave out
  };
  Reply Receive() {
    Reply r;
    Result<ipc::ReceivedMessage> m = ipc::ReceiveMessage(fd_.get(), 1 << 20);
    if (!m || m->eof) {
      r.eof = true;
      return r;
    }
    r.bytes = m->bytes;
    Result<const wire::Message*> msg = ipc::VerifyMessage(r.bytes);
    if (!msg) return r;
    r.body = (*msg)->body_type();
    r.id = (*msg)->id();
    if (r.body == wire::Body::Error) {
      r.code = ipc::CodeFromWire((*msg)->body_as_Error()->code());
      r.message = (*msg)->body_as_Error()->message()->str();
    }
    if (r.body == wire::Body::OpStarted) {
      r.event_recorded = (*msg)->body_as_OpStarted()->event_recorded();
      r.op = (*msg)->body_as_OpStarted()->op();
    }
    if (r.body == wire::Body::OpResult) {
      const wire::OpResult* o = (*msg)->body_as_OpResult();
      r.op = o->op();
      r.done = o->done();
      r.code = ipc::CodeFromWire(o->code());
      if (o->message() != nullptr) r.message = o->message()->str();
    }
    return r;
  }
  // Hello (with `token`, if any), not waiting for the Welcome.
  Status SendHello(const std::string& token = "") {
    flatbuffers::FlatBufferBuilder b;
    return Send(ipc::FinishMessage(
        b, 1, wire::CreateHelloDirect(b, ipc::kProtocolVersion, token.empty() ? nullptr : token.c_str())));
  }
  void Hello(const std::string& token = "") {
    ASSERT_TRUE(SendHello(token).ok());
    ASSERT_EQ(Receive().body, wire::Body::Welcome);
  }
  void Close() { fd_.Reset(); }

 private:
  UniqueFd fd_;
};

}  // namespace kvtier::testing
