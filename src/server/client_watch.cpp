#include "server/client_watch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>
#include <filesystem>

namespace strata::server {

namespace {

// "addr", port of a socket address (IPv4, IPv6); false for other families.
bool endpoint(const sockaddr_storage& ss, std::string& addr, int& port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    port = ntohs(a->sin6_port);
  } else {
    return false;
  }
  addr = buf;
  return true;
}

}  // namespace

ClientWatch::ClientWatch(int local_port, const std::string& remote_addr, int remote_port)
    : local_port_(local_port), remote_addr_(remote_addr), remote_port_(remote_port) {
  if (local_port < 0 || remote_port < 0) return;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const int fd = std::atoi(e.path().filename().c_str());
    if (same_connection(fd)) {
      fd_ = fd;
      break;
    }
  }
}

bool ClientWatch::same_connection(int fd) const {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  std::string addr;
  int port = -1;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 || !endpoint(ss, addr, port) || port != local_port_)
    return false;
  len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 || !endpoint(ss, addr, port)) return false;
  return port == remote_port_ && addr == remote_addr_;
}

bool ClientWatch::gone() const {
  if (fd_ < 0) return false;
  // httplib closes the socket only after the handler returns, so the descriptor is still this
  // connection's; checking the endpoints again guards against anything else.
  if (!same_connection(fd_)) return true;  // getpeername fails once the connection is reset
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLNVAL)) return true;
  char c;
  const ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace strata::server
