// ucx_connect: UCX's connection setup, measured the way bench/grpc_echo_perf.cc --connections
// measures gRPC's and rpc/scale_test swirl's (docs/BENCHMARKS.md "Connections").
//
//   ucx_connect [--connections N] [--client_core C] [--server_core C] [--err_mode peer|none]
//               [--busy] [--verbose]
//
// One client process opens N UCP endpoints one after another to a server process it forks
// (ucp_ep_create with UCP_EP_PARAM_FIELD_SOCK_ADDR to the server's ucp_listener on 127.0.0.1:
// UCX's connection manager over TCP sockets; UCX then picks the transports of each endpoint,
// on a machine without RDMA shared memory and/or TCP), one 64-byte active message on each
// before the next (sent with UCP_AM_SEND_FLAG_REPLY, echoed by the server on the reply
// endpoint, checked), all held open. It prints the setup rate and the CPU per setup of each
// process every N/4 endpoints, and at the end the time per setup (ep_create to the echo's
// arrival) and the memory per endpoint on each side: VmRSS growth (/proc/<pid>/status) after
// the first N/10, divided by the rest, as grpc_echo_perf does.
//
// A peer of swirl's benchmarks, not a part of swirl: it is built outside Bazel, on demand, by
// `./swirl bench ucx_connect` (libucx-dev, one of the swirl script's PEER_PACKAGES), so that
// `bazel build //...` never needs UCX.
//
// Waiting: by default each side sleeps on its worker's event fd (UCP_FEATURE_WAKEUP) when
// there is nothing to progress, as gRPC's synchronous client and server block; --busy polls
// instead (as ucx_perftest does), two cores busy for the whole run.
//
// --err_mode peer (the default, as UCX's ucp_client_server example) admits only transports that
// detect a peer's failure: TCP lanes here (lo and eth0; the shared-memory ones lack it), three
// sockets per endpoint on each side. --err_mode none lets UCX pick shared memory (sysv, cma),
// one socket (the connection manager's). UCX settings that change the figures are taken from
// the environment and printed (docs/BENCHMARKS.md "Connections": UCX_ASYNC_MAX_EVENTS,
// UCX_USE_MT_MUTEX).

#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

enum { kPayload = 64, kRequestId = 0, kReplyId = 1 };
static const int64_t kWaitNs = 10 * 1000000000LL;  // per endpoint: its echo, or the run fails

static int g_busy = 0;
// --err_mode: UCP_ERR_HANDLING_MODE_PEER (the default, as UCX's ucp_client_server example) or
// NONE. PEER admits only transports that detect a peer's failure.
static ucp_err_handling_mode_t g_err_mode = UCP_ERR_HANDLING_MODE_PEER;
// Counts the callbacks run (connection requests, messages, completions, errors): a progress
// call that returned 0 may still have run one, and then the caller has work and must not sleep.
static uint64_t g_events = 0;

static void Die(const char* format, ...) {
  va_list args;
  va_start(args, format);
  fprintf(stderr, "ucx_connect: ");
  vfprintf(stderr, format, args);
  fprintf(stderr, "\n");
  va_end(args);
  exit(1);
}

static int64_t MonoNs(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

// VmRSS of process `pid` (0: this one), KiB; -1 if it cannot be read. base/proc_status.h's
// ResidentKib, in C.
static int64_t ResidentKib(pid_t pid) {
  char path[64];
  if (pid == 0) {
    snprintf(path, sizeof(path), "/proc/self/status");
  } else {
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  }
  FILE* f = fopen(path, "r");
  if (f == NULL) return -1;
  char line[256];
  int64_t kib = -1;
  while (fgets(line, sizeof(line), f) != NULL) {
    if (strncmp(line, "VmRSS:", 6) == 0) {
      kib = strtoll(line + 6, NULL, 10);
      break;
    }
  }
  fclose(f);
  return kib;
}

// User + system CPU of process `pid` (all its threads: UCX's async thread too), in ms; -1 if
// unreadable. Fields 14 and 15 of /proc/<pid>/stat, after the parenthesized command name.
static double CpuMs(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
  FILE* f = fopen(path, "r");
  if (f == NULL) return -1;
  char buf[1024];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  char* p = strrchr(buf, ')');
  if (p == NULL) return -1;
  unsigned long long utime = 0, stime = 0;
  // After ")": state(3) ppid(4) pgrp(5) session(6) tty(7) tpgid(8) flags(9) minflt(10)
  // cminflt(11) majflt(12) cmajflt(13) utime(14) stime(15).
  if (sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) !=
      2) {
    return -1;
  }
  return (double)(utime + stime) * 1000.0 / (double)sysconf(_SC_CLK_TCK);
}

// Open file descriptors of process `pid` (sockets: one per endpoint and transport lane); -1 if
// unreadable.
static int OpenFds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  DIR* dir = opendir(path);
  if (dir == NULL) return -1;
  int count = 0;
  for (struct dirent* e; (e = readdir(dir)) != NULL;) count += e->d_name[0] != '.';
  closedir(dir);
  return count - 1;  // less the directory's own descriptor when pid is this process
}

static void Pin(int core, const char* who) {
  if (core < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    Die("cannot pin the %s to core %d: %s (give -1 to run it unpinned)", who, core,
        strerror(errno));
  }
}

static void Check(ucs_status_t status, const char* what) {
  if (status != UCS_OK) Die("%s: %s", what, ucs_status_string(status));
}

// One UCP context and worker with active messages and, unless --busy, wakeup.
static void Init(ucp_context_h* context, ucp_worker_h* worker, int* efd) {
  ucp_params_t params;
  memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | (g_busy ? 0 : UCP_FEATURE_WAKEUP);
  Check(ucp_init(&params, NULL, context), "ucp_init");
  ucp_worker_params_t wparams;
  memset(&wparams, 0, sizeof(wparams));
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  Check(ucp_worker_create(*context, &wparams, worker), "ucp_worker_create");
  *efd = -1;
  if (!g_busy) Check(ucp_worker_get_efd(*worker, efd), "ucp_worker_get_efd");
}

static void SetAmHandler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb,
                         void* arg) {
  ucp_am_handler_param_t param;
  memset(&param, 0, sizeof(param));
  param.field_mask =
      UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = id;
  param.cb = cb;
  param.arg = arg;
  Check(ucp_worker_set_am_recv_handler(worker, &param), "ucp_worker_set_am_recv_handler");
}

// Progresses `worker` until nothing is left to do, then (unless --busy) sleeps on its event fd
// and on `extra_fd` (if >= 0) for at most `timeout_ms`. Returns 1 if extra_fd became readable.
static int ProgressOrWait(ucp_worker_h worker, int efd, int extra_fd, int timeout_ms) {
  const uint64_t events = g_events;
  if (ucp_worker_progress(worker) != 0 || g_busy || g_events != events) return 0;
  const ucs_status_t armed = ucp_worker_arm(worker);
  if (armed == UCS_ERR_BUSY) return 0;  // events arrived meanwhile: progress again
  Check(armed, "ucp_worker_arm");
  struct pollfd fds[2] = {{.fd = efd, .events = POLLIN}, {.fd = extra_fd, .events = POLLIN}};
  const int n = poll(fds, extra_fd >= 0 ? 2 : 1, timeout_ms);
  if (n < 0 && errno != EINTR) Die("poll: %s", strerror(errno));
  return n > 0 && extra_fd >= 0 && (fds[1].revents & POLLIN) != 0;
}

// ---- server -------------------------------------------------------------------------------

// Connection requests and echoes, taken by the callbacks and answered from the main loop
// (ucp_ep_create and sends are not made from inside ucp_worker_progress's callbacks).
typedef struct {
  ucp_conn_request_h* conn_requests;
  size_t conn_count, conn_capacity;
  ucp_ep_h* eps;  // every accepted endpoint, held until the end
  size_t ep_count, ep_capacity;
  ucp_ep_h reply_ep;  // the one echo pending (the client sends one at a time)
  uint8_t reply[kPayload];
  int reply_pending;
  uint64_t dropped;  // echoes that arrived while one was pending, or malformed: never expected
  uint64_t ep_errors;
} Server;

static void* Grow(void* array, size_t* capacity, size_t element) {
  *capacity = *capacity == 0 ? 1024 : *capacity * 2;
  void* grown = realloc(array, *capacity * element);
  if (grown == NULL) Die("out of memory");
  return grown;
}

static void ServerConnHandler(ucp_conn_request_h request, void* arg) {
  ++g_events;
  Server* s = arg;
  if (s->conn_count == s->conn_capacity) {
    s->conn_requests = Grow(s->conn_requests, &s->conn_capacity, sizeof(*s->conn_requests));
  }
  s->conn_requests[s->conn_count++] = request;
}

static ucs_status_t ServerAm(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param) {
  ++g_events;
  (void)header;
  (void)header_length;
  Server* s = arg;
  // The client's input, checked before use: one eager 64-byte message (its data here, valid
  // for this call; not a rendezvous descriptor) with a reply endpoint.
  if (s->reply_pending || length != kPayload ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0 ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    ++s->dropped;
    return UCS_OK;
  }
  memcpy(s->reply, data, kPayload);
  s->reply_ep = param->reply_ep;
  s->reply_pending = 1;
  return UCS_OK;
}

static void ServerEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  ++g_events;
  (void)ep;
  (void)status;
  ++((Server*)arg)->ep_errors;  // the client gone: expected only at the end
}

static void ServerSent(void* request, ucs_status_t status, void* user_data) {
  ++g_events;
  if (status != UCS_OK) fprintf(stderr, "ucx_connect server: echo: %s\n", ucs_status_string(status));
  *(int*)user_data = 0;
  ucp_request_free(request);  // here, not at the send: a request freed earlier gets no callback
}

static int RunServer(int port_fd, int server_core) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  Pin(server_core, "server");  // before UCX starts its async thread, which inherits it
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  sigprocmask(SIG_BLOCK, &stop, NULL);
  const int stop_fd = signalfd(-1, &stop, SFD_NONBLOCK | SFD_CLOEXEC);
  if (stop_fd < 0) Die("signalfd: %s", strerror(errno));

  ucp_context_h context;
  ucp_worker_h worker;
  int efd;
  Init(&context, &worker, &efd);
  Server s;
  memset(&s, 0, sizeof(s));
  SetAmHandler(worker, kRequestId, ServerAm, &s);

  struct sockaddr_in addr;
  memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;  // any free port, reported to the client through port_fd
  ucp_listener_params_t lparams;
  memset(&lparams, 0, sizeof(lparams));
  lparams.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lparams.sockaddr.addr = (const struct sockaddr*)&addr;
  lparams.sockaddr.addrlen = sizeof(addr);
  lparams.conn_handler.cb = ServerConnHandler;
  lparams.conn_handler.arg = &s;
  ucp_listener_h listener;
  Check(ucp_listener_create(worker, &lparams, &listener), "ucp_listener_create on 127.0.0.1");
  ucp_listener_attr_t lattr;
  lattr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  Check(ucp_listener_query(listener, &lattr), "ucp_listener_query");
  const uint16_t port = ntohs(((struct sockaddr_in*)&lattr.sockaddr)->sin_port);
  if (write(port_fd, &port, sizeof(port)) != sizeof(port)) Die("server: cannot report its port");
  close(port_fd);

  int sending = 0;
  for (;;) {
    if (ProgressOrWait(worker, efd, stop_fd, g_busy ? 0 : 1000)) break;
    if (g_busy) {
      struct signalfd_siginfo info;
      if (read(stop_fd, &info, sizeof(info)) == sizeof(info)) break;
    }
    for (size_t i = 0; i < s.conn_count; ++i) {
      ucp_ep_params_t ep_params;
      memset(&ep_params, 0, sizeof(ep_params));
      ep_params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                             UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      ep_params.conn_request = s.conn_requests[i];
      ep_params.err_mode = g_err_mode;
      ep_params.err_handler.cb = ServerEpError;
      ep_params.err_handler.arg = &s;
      ucp_ep_h ep;
      const ucs_status_t status = ucp_ep_create(worker, &ep_params, &ep);
      if (status != UCS_OK) {
        fprintf(stderr, "ucx_connect server: ucp_ep_create: %s\n", ucs_status_string(status));
        continue;  // the client will time out and say so
      }
      if (s.ep_count == s.ep_capacity) s.eps = Grow(s.eps, &s.ep_capacity, sizeof(*s.eps));
      s.eps[s.ep_count++] = ep;
    }
    s.conn_count = 0;
    if (s.reply_pending && !sending) {
      ucp_request_param_t param;
      memset(&param, 0, sizeof(param));
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = ServerSent;
      param.user_data = &sending;
      sending = 1;  // s.reply stays untouched until the send completes
      const ucs_status_ptr_t request =
          ucp_am_send_nbx(s.reply_ep, kReplyId, NULL, 0, s.reply, kPayload, &param);
      if (request == NULL) {
        sending = 0;  // completed in place; the callback is not called
      } else if (UCS_PTR_IS_ERR(request)) {
        sending = 0;
        fprintf(stderr, "ucx_connect server: echo: %s\n",
                ucs_status_string(UCS_PTR_STATUS(request)));
      }  // else ServerSent frees the request
      s.reply_pending = 0;
    }
  }
  if (s.ep_errors != 0) fprintf(stderr, "ucx_connect server: %llu endpoints failed\n",
                                (unsigned long long)s.ep_errors);
  if (s.dropped != 0) fprintf(stderr, "ucx_connect server: %llu unexpected messages\n",
                              (unsigned long long)s.dropped);
  // Exit without closing the endpoints one by one: the measurement is over, and the process's
  // end releases everything.
  _exit(s.dropped == 0 ? 0 : 1);
}

// ---- client -------------------------------------------------------------------------------

typedef struct {
  uint64_t got_sequence;
  int got;
  ucs_status_t ep_error;
} Client;

static ucs_status_t ClientAm(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param) {
  ++g_events;
  (void)header;
  (void)header_length;
  Client* c = arg;
  if (length != kPayload || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    Die("an echo of %zu bytes (sent %d)", length, kPayload);
  }
  memcpy(&c->got_sequence, data, sizeof(c->got_sequence));
  c->got = 1;
  return UCS_OK;
}

static void ClientEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  ++g_events;
  (void)ep;
  ((Client*)arg)->ep_error = status;
}

static ucs_status_t g_send_status = UCS_OK;

static void ClientSent(void* request, ucs_status_t status, void* user_data) {
  ++g_events;
  (void)request;
  g_send_status = status;
  *(int*)user_data = 0;
}

// What an endpoint's failure most likely meets, said beside UCX's own status text (which names
// neither): the file descriptor limit, or UCX's async event set (UCX_ASYNC_MAX_EVENTS, 1,024 by
// default, which every connection manager socket joins: about 1,017 endpoints per process).
static const char* FailureHint(int i) {
  static char hint[256];
  struct rlimit limit;
  const int fds = OpenFds(getpid());
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && fds >= 0 && (rlim_t)fds + 16 >= limit.rlim_cur) {
    snprintf(hint, sizeof(hint), " (%d file descriptors open, the limit %llu)", fds,
             (unsigned long long)limit.rlim_cur);
  } else if (i >= 1000 && getenv("UCX_ASYNC_MAX_EVENTS") == NULL) {
    snprintf(hint, sizeof(hint), " (UCX_ASYNC_MAX_EVENTS is 1024 by default: about 1,017 "
             "endpoints per process; set it higher)");
  } else {
    hint[0] = '\0';
  }
  return hint;
}

static int CompareInt64(const void* a, const void* b) {
  const int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return (x > y) - (x < y);
}

static int RunClient(int n, uint16_t port, pid_t server, int verbose) {
  ucp_context_h context;
  ucp_worker_h worker;
  int efd;
  Init(&context, &worker, &efd);
  Client c;
  memset(&c, 0, sizeof(c));
  c.ep_error = UCS_OK;
  SetAmHandler(worker, kReplyId, ClientAm, &c);

  struct sockaddr_in addr;
  memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);

  ucp_ep_h* eps = calloc((size_t)n, sizeof(*eps));
  int64_t* setup_ns = calloc((size_t)n, sizeof(*setup_ns));
  if (eps == NULL || setup_ns == NULL) Die("out of memory");
  uint8_t payload[kPayload];
  memset(payload, 'x', sizeof(payload));
  const int quarter = n / 4, base_count = n / 10;
  int64_t client_base = 0, server_base = 0;
  const int64_t begin = MonoNs();
  int64_t quarter_begin = begin, measured_begin = begin;
  double client_cpu_mark = CpuMs(getpid()), server_cpu_mark = CpuMs(server);
  for (int i = 0; i < n; ++i) {
    if (i == base_count) {
      client_base = ResidentKib(0);
      server_base = ResidentKib(server);
      measured_begin = MonoNs();
    }
    const int64_t start = MonoNs();
    ucp_ep_params_t ep_params;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep_params.sockaddr.addr = (const struct sockaddr*)&addr;
    ep_params.sockaddr.addrlen = sizeof(addr);
    ep_params.err_mode = g_err_mode;
    ep_params.err_handler.cb = ClientEpError;
    ep_params.err_handler.arg = &c;
    const ucs_status_t created = ucp_ep_create(worker, &ep_params, &eps[i]);
    if (created != UCS_OK) {
      Die("endpoint %d: ucp_ep_create to 127.0.0.1:%u: %s%s", i, port, ucs_status_string(created),
          FailureHint(i));
    }
    const uint64_t sequence = (uint64_t)i;
    memcpy(payload, &sequence, sizeof(sequence));
    c.got = 0;
    int sending = 1;
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    param.cb.send = ClientSent;
    param.user_data = &sending;
    const ucs_status_ptr_t request =
        ucp_am_send_nbx(eps[i], kRequestId, NULL, 0, payload, kPayload, &param);
    if (request == NULL) {
      sending = 0;
    } else if (UCS_PTR_IS_ERR(request)) {
      Die("endpoint %d: ucp_am_send_nbx: %s", i, ucs_status_string(UCS_PTR_STATUS(request)));
    }
    const int64_t deadline = start + kWaitNs;
    while (sending || !c.got) {
      if (c.ep_error != UCS_OK) {
        Die("endpoint %d: failed: %s%s", i, ucs_status_string(c.ep_error), FailureHint(i));
      }
      if (g_send_status != UCS_OK) {
        Die("endpoint %d: ucp_am_send_nbx completed with %s%s", i,
            ucs_status_string(g_send_status), FailureHint(i));
      }
      const int64_t now = MonoNs();
      if (now > deadline) {
        Die("endpoint %d: no echo within 10 s (%s)", i, sending ? "the send pending" : "sent");
      }
      ProgressOrWait(worker, efd, -1, (int)((deadline - now) / 1000000 + 1));
    }
    if (request != NULL) ucp_request_free(request);
    if (c.got_sequence != sequence) Die("endpoint %d: the echo came back wrong", i);
    setup_ns[i] = MonoNs() - start;
    if (i == 0 && verbose) ucp_ep_print_info(eps[0], stdout);
    if (quarter > 0 && (i + 1) % quarter == 0) {
      const int64_t now = MonoNs();
      const double client_cpu = CpuMs(getpid()), server_cpu = CpuMs(server);
      printf(" %d held: %.0f setups/s over the last %d; CPU ms per setup client %.2f, server "
             "%.2f\n",
             i + 1, quarter * 1e9 / (double)(now - quarter_begin), quarter,
             (client_cpu - client_cpu_mark) / quarter, (server_cpu - server_cpu_mark) / quarter);
      fflush(stdout);
      quarter_begin = now;
      client_cpu_mark = client_cpu;
      server_cpu_mark = server_cpu;
    }
  }
  const int64_t end = MonoNs();
  const int64_t client_kib = ResidentKib(0) - client_base;
  const int64_t server_kib = ResidentKib(server) - server_base;
  const int measured = n - base_count;
  qsort(setup_ns, (size_t)n, sizeof(*setup_ns), CompareInt64);
  printf("UCX %s: %d endpoints (ucp_ep_create to a ucp_listener on 127.0.0.1, the sockaddr "
         "connection manager) opened one after another, one 64 B active-message echo on each, "
         "all held; %.0f setups/s after the first %d (%.2f s in all); time per setup p50 %.3f ms, "
         "p99 %.3f ms, max %.3f ms; memory per endpoint: client %.1f KiB, server %.1f KiB; "
         "open fds: client %d, server %d\n",
         ucp_get_version_string(), n, measured * 1e9 / (double)(end - measured_begin), base_count,
         (end - begin) / 1e9, setup_ns[n / 2] / 1e6, setup_ns[(size_t)(n * 0.99)] / 1e6,
         setup_ns[n - 1] / 1e6, (double)client_kib / measured, (double)server_kib / measured, OpenFds(getpid()),
         OpenFds(server));
  fflush(stdout);
  // The endpoints stay open until the process ends (the server is stopped first, by main).
  return 0;
}

// ---- main ---------------------------------------------------------------------------------

int main(int argc, char** argv) {
  int n = 1000, client_core = 0, server_core = 1, verbose = 0;
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(arg, "--connections") == 0 && value != NULL) {
      n = atoi(value), ++i;
    } else if (strcmp(arg, "--client_core") == 0 && value != NULL) {
      client_core = atoi(value), ++i;
    } else if (strcmp(arg, "--server_core") == 0 && value != NULL) {
      server_core = atoi(value), ++i;
    } else if (strcmp(arg, "--busy") == 0) {
      g_busy = 1;
    } else if (strcmp(arg, "--err_mode") == 0 && value != NULL) {
      if (strcmp(value, "peer") == 0) {
        g_err_mode = UCP_ERR_HANDLING_MODE_PEER;
      } else if (strcmp(value, "none") == 0) {
        g_err_mode = UCP_ERR_HANDLING_MODE_NONE;
      } else {
        Die("--err_mode: peer or none");
      }
      ++i;
    } else if (strcmp(arg, "--verbose") == 0) {
      verbose = 1;
    } else {
      fprintf(stderr,
              "usage: ucx_connect [--connections N (>= 10, default 1000)] [--client_core C] "
              "[--server_core C] [--err_mode peer|none] [--busy] [--verbose]\n");
      return 2;
    }
  }
  if (n < 10) Die("--connections: at least 10");
  // Sockets: one per endpoint for the connection manager and one per TCP lane (three in all
  // with lanes on lo and eth0), on each side; the server, forked below, inherits the limit.
  // Raised to the hard limit, and past it where the process may (root).
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    const rlim_t wanted = (rlim_t)n * 4 + 256;
    struct rlimit raised = {wanted, wanted};
    if (limit.rlim_max >= wanted || setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      limit.rlim_cur = limit.rlim_max;
      setrlimit(RLIMIT_NOFILE, &limit);
      if (limit.rlim_max < wanted) {
        fprintf(stderr, "ucx_connect: warning: %llu file descriptors allowed, %d endpoints may "
                "need %llu\n", (unsigned long long)limit.rlim_max, n,
                (unsigned long long)wanted);
      }
    }
  }
  signal(SIGPIPE, SIG_IGN);
  int port_pipe[2];
  if (pipe(port_pipe) != 0) Die("pipe: %s", strerror(errno));
  // Fork before either side initializes UCX: each process gets its own context and threads.
  const pid_t server = fork();
  if (server < 0) Die("fork: %s", strerror(errno));
  if (server == 0) {
    close(port_pipe[0]);
    return RunServer(port_pipe[1], server_core);
  }
  close(port_pipe[1]);
  Pin(client_core, "client");
  struct pollfd pfd = {.fd = port_pipe[0], .events = POLLIN};
  uint16_t port = 0;
  if (poll(&pfd, 1, 30000) != 1 || read(port_pipe[0], &port, sizeof(port)) != sizeof(port)) {
    kill(server, SIGKILL);
    Die("the server did not start listening within 30 s");
  }
  close(port_pipe[0]);
  printf("ucx_connect: UCX %s, server pid %d on 127.0.0.1:%u, client core %d, server core %d, "
         "%s, error handling %s",
         ucp_get_version_string(), (int)server, port, client_core, server_core,
         g_busy ? "busy polling" : "sleeping on the worker's event fd when idle",
         g_err_mode == UCP_ERR_HANDLING_MODE_PEER ? "peer" : "none");
  extern char** environ;
  for (char** e = environ; *e != NULL; ++e) {
    if (strncmp(*e, "UCX_", 4) == 0) printf(", %s", *e);  // settings that change what is measured
  }
  printf("\n");
  fflush(stdout);
  const int rc = RunClient(n, port, server, verbose);
  kill(server, SIGTERM);
  int status = 0;
  const int64_t deadline = MonoNs() + 10 * 1000000000LL;
  pid_t waited = 0;
  while ((waited = waitpid(server, &status, WNOHANG)) == 0 && MonoNs() < deadline) {
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
  if (waited != server) {
    kill(server, SIGKILL);
    Die("the server did not exit within 10 s of SIGTERM");
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die("the server exited with status %d", status);
  return rc;
}
