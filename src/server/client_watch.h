#pragma once
// Noticing that the client of a non-streaming request hung up. cpp-httplib 0.11 (Debian 12)
// gives a handler no access to its connection's socket, and a handler that only waits never
// writes, so a gone client would go unnoticed until the answer is sent. ClientWatch finds the
// connection's socket among this process's descriptors by its two endpoints (the local port
// and the peer's address and port, which identify one TCP connection) and reports the peer's
// orderly close (FIN) or reset.
#include <string>

namespace strata::server {

class ClientWatch {
 public:
  /// Looks up the socket connected from remote_addr:remote_port to local_port (IPv4 or IPv6,
  /// as httplib prints them). When none is found (e.g. not a TCP connection), gone() is false.
  ClientWatch(int local_port, const std::string& remote_addr, int remote_port);
  /// True once the peer has closed or reset the connection: the socket is readable with no
  /// bytes (MSG_PEEK) or in error. Bytes the client sent after its request (a pipelined
  /// request) count as alive. Never blocks.
  bool gone() const;
  bool found() const { return fd_ >= 0; }

 private:
  bool same_connection(int fd) const;
  int fd_ = -1;
  int local_port_;
  std::string remote_addr_;
  int remote_port_;
};

}  // namespace strata::server
