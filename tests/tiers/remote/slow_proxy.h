// SlowProxy: a TCP proxy on 127.0.0.1 in front of one Redis node, slow in
// one direction: a node that answers slowly, or one that takes what it is
// sent slowly (an overloaded node, a lossy link).
//   kReplies   requests pass at once; replies trickle back, `piece_bytes`
//              at a time with `interval` between pieces;
//   kRequests  replies pass at once; requests are read `piece_bytes` at a
//              time with `interval` between reads, from a socket with a
//              small receive buffer, so that the sender's writes wait.
// Fault injection at the network seam, for what Redis cannot do itself.
// set_interval changes the pace at once, for every connection (a link that
// recovers: an interval of 0).
//
// For tests only. Stops (closing every connection) when destroyed.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "tiers/remote/cluster_slots.h"

namespace kvtier::testing {

class SlowProxy {
 public:
  enum class Slow { kReplies, kRequests };

  SlowProxy(NodeAddress target, size_t piece_bytes, std::chrono::milliseconds interval,
            Slow slow = Slow::kReplies)
      : target_(std::move(target)), piece_bytes_(piece_bytes), interval_ms_(interval.count()), slow_(slow) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (slow_ == Slow::kRequests) {
      // Accepted sockets inherit it: the kernel holds little for the sender.
      const int bytes = static_cast<int>(piece_bytes_);
      ::setsockopt(listener_, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        ::listen(listener_, 16) == 0 &&
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
    accepter_ = std::thread([this] { Accept(); });
  }
  ~SlowProxy() {
    stopping_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    accepter_.join();
    {
      std::lock_guard lock(mu_);
      for (const int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (std::thread& t : pumps_) t.join();
    for (const int fd : fds_) ::close(fd);
    ::close(listener_);
  }
  SlowProxy(const SlowProxy&) = delete;
  SlowProxy& operator=(const SlowProxy&) = delete;

  NodeAddress address() const { return NodeAddress{"127.0.0.1", port_}; }
  void set_interval(std::chrono::milliseconds interval) { interval_ms_ = interval.count(); }

 private:
  void Accept() {
    while (!stopping_) {
      const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) return;
      const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(target_.port);
      ::inet_pton(AF_INET, target_.host.c_str(), &addr.sin_addr);
      if (::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        ::close(server);
        ::close(client);
        continue;
      }
      std::lock_guard lock(mu_);
      fds_.push_back(client);
      fds_.push_back(server);
      if (slow_ == Slow::kReplies) {
        pumps_.emplace_back([this, client, server] { Pump(client, server, SIZE_MAX, false); });
        pumps_.emplace_back([this, client, server] { Pump(server, client, piece_bytes_, true); });
      } else {
        pumps_.emplace_back([this, client, server] { SlowReads(client, server); });
        pumps_.emplace_back([this, client, server] { Pump(server, client, SIZE_MAX, false); });
      }
    }
  }
  // Copies `from` to `to`, `piece` bytes per write, with the interval
  // between them where `paced`.
  void Pump(int from, int to, size_t piece, bool paced) {
    std::vector<char> buf(64 << 10);
    while (!stopping_) {
      const ssize_t n = ::read(from, buf.data(), buf.size());
      if (n <= 0) break;
      for (ssize_t at = 0; at < n && !stopping_;) {
        const size_t len = std::min<size_t>(piece, static_cast<size_t>(n - at));
        if (::send(to, buf.data() + at, len, MSG_NOSIGNAL) <= 0) return;
        at += static_cast<ssize_t>(len);
        if (paced && at < n) std::this_thread::sleep_for(interval());
      }
    }
    ::shutdown(to, SHUT_WR);
  }
  // Copies `from` to `to`, reading `piece_bytes_` at most every `interval_`.
  void SlowReads(int from, int to) {
    std::vector<char> buf(piece_bytes_);
    while (!stopping_) {
      const ssize_t n = ::read(from, buf.data(), buf.size());
      if (n <= 0) break;
      if (::send(to, buf.data(), static_cast<size_t>(n), MSG_NOSIGNAL) != n) return;
      std::this_thread::sleep_for(interval());
    }
    ::shutdown(to, SHUT_WR);
  }

  std::chrono::milliseconds interval() const { return std::chrono::milliseconds(interval_ms_.load()); }

  const NodeAddress target_;
  const size_t piece_bytes_;
  std::atomic<int64_t> interval_ms_;
  const Slow slow_;
  int listener_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread accepter_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
};

}  // namespace kvtier::testing
