/* server: what a client's socket says, without reading from it: a FIN, a
 * reset, and whether it still takes the data sent to it (see generate.h). */
#define _GNU_SOURCE /* POLLRDHUP */
#include <errno.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <netinet/in.h> /* IPPROTO_TCP */
#include <poll.h>
#include <stddef.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include "server/generate.h"

kvs_peer kvs_peer_state(int fd) {
    if (fd < 0) return KVS_PEER_OPEN;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return KVS_PEER_OPEN;
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return KVS_PEER_GONE;
    return p.revents & POLLRDHUP ? KVS_PEER_EOF : KVS_PEER_OPEN;
}

bool kvs_peer_probe_1xx(int fd) {
    static const char probe[] = "HTTP/1.1 100 Continue\r\n\r\n";
    ssize_t n = send(fd, probe, sizeof probe - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    return n == (ssize_t)(sizeof probe - 1) || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
}

void kvs_peer_progress_init(kvs_peer_progress *p) {
    p->acked = 0;
    p->progress_at = kvs_now();
}

bool kvs_peer_stalled(int fd, kvs_peer_progress *p, double limit_s) {
    if (fd < 0) return false;
    int queued = 0;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (ioctl(fd, SIOCOUTQ, &queued) != 0 || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 ||
        len < offsetof(struct tcp_info, tcpi_bytes_acked) + sizeof ti.tcpi_bytes_acked)
        return false;
    double now = kvs_now();
    if (queued == 0 || ti.tcpi_bytes_acked != p->acked) { /* caught up, or took more */
        p->acked = ti.tcpi_bytes_acked;
        p->progress_at = now;
        return false;
    }
    return now - p->progress_at > limit_s;
}
