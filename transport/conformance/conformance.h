// Shared fixtures for the verbs conformance suite.
//
// The suite is written against plain verbs only: the inline data-path calls (ibv_post_send,
// ibv_poll_cq, ibv_alloc_mw, ...) and swirl's RAII control path (transport/verbs/verbs.h). It
// never looks inside the soft device, so the same tests measure the soft device's fidelity
// against any rdma-core device present. Every test runs once per device in DevicesUnderTest().
//
// Waiting: the soft device moves data only when the application calls into it, so every wait
// here keeps polling (ibv_poll_cq(cq, 0, nullptr), which only makes progress) every completion
// queue the suite created and still holds, and gives up at a deadline (kTimeout unless told).

#ifndef SWIRL_TRANSPORT_CONFORMANCE_CONFORMANCE_H_
#define SWIRL_TRANSPORT_CONFORMANCE_CONFORMANCE_H_

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/strip.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/conformance/peer_protocol.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {

// The longest any single wait may take.
inline constexpr absl::Duration kTimeout = absl::Seconds(10);

inline constexpr int kRemoteAccess =
    IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
inline constexpr int kFullAccess = IBV_ACCESS_LOCAL_WRITE | kRemoteAccess | IBV_ACCESS_MW_BIND;

// ---- Devices -----------------------------------------------------------------------------------

// "soft0", then every rdma-core device libibverbs lists. SWIRL_CONFORMANCE_DEVICES (a comma-
// separated list of names) replaces the list.
std::vector<std::string> DevicesUnderTest();

// A gtest-safe parameter name for a device.
std::string DeviceParamName(const ::testing::TestParamInfo<std::string>& info);

#define SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(suite)                                         \
  INSTANTIATE_TEST_SUITE_P(Devices, suite,                                                \
                           ::testing::ValuesIn(::swirl::conformance::DevicesUnderTest()), \
                           ::swirl::conformance::DeviceParamName)

// Connection parameters used throughout: ConnectOptions' defaults (67 ms ACK timeout, 7 retries,
// infinite RNR retry), with the GID index from SWIRL_CONFORMANCE_GID_INDEX if set (RoCE).
verbs::ConnectOptions DefaultConnectOptions();

// What the device under test advertises, for the few tests that need an optional feature.
struct DeviceFacts {
  bool atomics = false;
  bool mw_type1 = false;
  bool mw_type2 = false;
};
// A failed query fails the current test (ADD_FAILURE): it is never a reason to skip.
DeviceFacts QueryFacts(verbs::Context& ctx);

// ---- Memory ------------------------------------------------------------------------------------

// Page-aligned, zero-filled memory owned by the test.
class Buffer {
 public:
  explicit Buffer(size_t size);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  uint64_t addr(size_t offset = 0) const { return reinterpret_cast<uint64_t>(data_ + offset); }

 private:
  char* data_;
  size_t size_;
};

// Fills with the pattern PatternByte(seed, i) (peer_protocol.h).
void FillPattern(void* data, size_t length, uint64_t seed);
// The index of the first byte that differs from the pattern, or -1.
int64_t FindPatternMismatch(const void* data, size_t length, uint64_t seed);

// ---- Progress ----------------------------------------------------------------------------------

// Adds `cq` to the set every wait keeps polling (held weakly: a destroyed CQ drops out).
void Track(const std::shared_ptr<verbs::CompletionQueue>& cq);
// Removes `cq` from that set (a test that must show someone else makes progress for it).
void Untrack(const verbs::CompletionQueue* cq);
// One round of ibv_poll_cq(cq, 0, nullptr) over every tracked CQ except `except`.
void ProgressAll(const verbs::CompletionQueue* except = nullptr);

// ---- Endpoints ---------------------------------------------------------------------------------

struct EndpointOptions {
  int cq_entries = 256;
  // Optional: use these CQs instead of creating new ones.
  std::shared_ptr<verbs::CompletionQueue> send_cq;
  std::shared_ptr<verbs::CompletionQueue> recv_cq;
  // Optional: the channel for a newly created receive CQ.
  std::shared_ptr<verbs::CompletionChannel> recv_channel;
  std::shared_ptr<verbs::SharedReceiveQueue> srq;
  uint32_t max_send_wr = 64;
  uint32_t max_recv_wr = 64;
  uint32_t max_send_sge = 4;
  uint32_t max_recv_sge = 4;
  uint32_t max_inline_data = 0;
  bool sq_sig_all = false;
  // The CQs created here are extended CQs (ibv_create_cq_ex) with these wc_flags.
  bool extended_cqs = false;
  uint64_t cq_wc_flags = IBV_WC_STANDARD_FLAGS;
  // Non-zero: the QP is made by ibv_create_qp_ex for these IBV_QP_EX_WITH_* operations (the
  // ibv_wr_* API, Endpoint::qpx()).
  uint64_t send_ops_flags = 0;
  size_t buffer_size = 2 << 20;
  int mr_access = kFullAccess;
};

// One RC QP with its CQs and a registered buffer.
class Endpoint {
 public:
  // On a new context of `device`.
  static absl::StatusOr<std::unique_ptr<Endpoint>> Create(const std::string& device,
                                                          const EndpointOptions& options = {});
  // On an existing protection domain (another QP of the same process-side "application").
  static absl::StatusOr<std::unique_ptr<Endpoint>> Create(
      std::shared_ptr<verbs::ProtectionDomain> pd, const EndpointOptions& options = {});

  verbs::Context& context() const { return pd_->context(); }
  const std::shared_ptr<verbs::Context>& shared_context() const { return pd_->shared_context(); }
  const std::shared_ptr<verbs::ProtectionDomain>& pd() const { return pd_; }
  verbs::CompletionQueue& send_cq() const { return *send_cq_; }
  verbs::CompletionQueue& recv_cq() const { return *recv_cq_; }
  const std::shared_ptr<verbs::CompletionQueue>& shared_send_cq() const { return send_cq_; }
  const std::shared_ptr<verbs::CompletionQueue>& shared_recv_cq() const { return recv_cq_; }
  verbs::QueuePair& qp() const { return *qp_; }
  ibv_qp* ibqp() const { return qp_->get(); }
  // The QP's ibv_wr_* interface (EndpointOptions::send_ops_flags), or nullptr.
  ibv_qp_ex* qpx() const { return qp_->ex(); }
  uint32_t qpn() const { return qp_->qp_num(); }
  verbs::MemoryRegion& mr() const { return *mr_; }
  uint32_t lkey() const { return mr_->lkey(); }
  uint32_t rkey() const { return mr_->rkey(); }
  char* data(size_t offset = 0) const { return buffer_->data() + offset; }
  uint64_t addr(size_t offset = 0) const { return buffer_->addr(offset); }
  size_t size() const { return buffer_->size(); }

  // Posts one receive of [offset, offset+length) of the buffer; returns ibv_post_recv's result.
  int PostRecv(uint64_t wr_id, size_t offset, uint32_t length);
  // Posts one receive with these scatter entries (possibly none).
  int PostRecv(uint64_t wr_id, const std::vector<ibv_sge>& sges);

 private:
  Endpoint() = default;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::shared_ptr<verbs::CompletionQueue> send_cq_;
  std::shared_ptr<verbs::CompletionQueue> recv_cq_;
  std::unique_ptr<verbs::QueuePair> qp_;
  std::unique_ptr<Buffer> buffer_;
  std::unique_ptr<verbs::MemoryRegion> mr_;  // after buffer_: deregistered before it is freed
};

// Connects `a` and `b` to each other (RESET -> INIT -> RTR -> RTS on both).
absl::Status ConnectPair(Endpoint& a, Endpoint& b,
                         const verbs::ConnectOptions& a_options = DefaultConnectOptions(),
                         const verbs::ConnectOptions& b_options = DefaultConnectOptions());

// Makes one zero-length SEND in each direction and checks its completions, so every test
// starts from a pair known to carry traffic both ways (a failure here points at the connection,
// not at the feature under test). Teardown with a link still being set up is covered on purpose
// by teardown_test. Harmless on hardware: it consumes only the receives it posts itself.
void WarmUp(Endpoint& a, Endpoint& b);

// ---- Work requests -----------------------------------------------------------------------------

// An ibv_send_wr with its scatter/gather list, built fluently:
//   SendWr(1, IBV_WR_RDMA_WRITE).Local(a, 0, 64).Remote(b.addr(), b.rkey()).Post(a.ibqp())
class SendWr {
 public:
  SendWr(uint64_t wr_id, ibv_wr_opcode opcode, unsigned int flags = IBV_SEND_SIGNALED);

  SendWr& Sge(uint64_t addr, uint32_t length, uint32_t lkey);
  SendWr& Local(const Endpoint& ep, size_t offset, uint32_t length);
  SendWr& Remote(uint64_t remote_addr, uint32_t rkey);
  SendWr& Imm(uint32_t imm_data);
  SendWr& Invalidate(uint32_t rkey);
  SendWr& Atomic(uint64_t remote_addr, uint32_t rkey, uint64_t compare_add, uint64_t swap = 0);
  SendWr& Bind(ibv_mw* mw, uint32_t rkey, ibv_mr* mr, uint64_t addr, uint64_t length,
               unsigned int access);
  SendWr& Flags(unsigned int flags);
  // Chains `next` (which must outlive this one) behind this request: one ibv_post_send posts both.
  SendWr& Then(SendWr& next);

  ibv_send_wr* get();
  // ibv_post_send's result; `bad_wr` (optional) receives its bad_wr.
  int Post(ibv_qp* qp, ibv_send_wr** bad_wr = nullptr);

 private:
  ibv_send_wr wr_{};
  std::vector<ibv_sge> sges_;
  SendWr* next_ = nullptr;
};

// Posts a type 2 bind through `qp` and returns the bind's completion (the QP's send CQ).
ibv_wc BindType2(Endpoint& ep, ibv_mw* mw, uint32_t rkey, ibv_mr* mr, uint64_t addr,
                 uint64_t length, unsigned int access, uint64_t wr_id = 0xb1d);

// ---- Completions -------------------------------------------------------------------------------

// wr_id of the placeholder a failed wait returns (its status is IBV_WC_GENERAL_ERR).
inline constexpr uint64_t kNoCompletion = ~uint64_t{0};

// The next completion on `cq`, or nullopt after `timeout`. Progresses every tracked CQ.
std::optional<ibv_wc> TryPoll(verbs::CompletionQueue& cq, absl::Duration timeout = kTimeout);
// Like TryPoll, but a timeout (or a poll_cq failure) is a test failure and yields a placeholder.
ibv_wc Poll(verbs::CompletionQueue& cq, absl::Duration timeout = kTimeout);
// `n` completions (fewer only after a recorded failure).
std::vector<ibv_wc> PollN(verbs::CompletionQueue& cq, int n, absl::Duration timeout = kTimeout);
// Everything that arrives on `cq` while progressing for exactly `window` (for "nothing happens"
// checks; a bounded observation, not a wait).
std::vector<ibv_wc> Observe(verbs::CompletionQueue& cq, absl::Duration window);

// Progresses every tracked CQ until `done` holds; false at the deadline.
bool WaitUntil(const std::function<bool()>& done, absl::Duration timeout = kTimeout);
// Waits for `qp` to report `state`; false (with the last state in the failure) at the deadline.
bool WaitForState(verbs::QueuePair& qp, ibv_qp_state state, absl::Duration timeout = kTimeout);
ibv_qp_state StateOf(verbs::QueuePair& qp);

// The fields a test expects of a completion; unset optionals are not checked. Per ibv_poll_cq(3)
// only wr_id, status and qp_num are defined for a failed completion, so tests set no more there.
struct ExpectedWc {
  uint64_t wr_id = 0;
  ibv_wc_status status = IBV_WC_SUCCESS;
  uint32_t qp_num = 0;
  std::optional<ibv_wc_opcode> opcode;
  std::optional<uint32_t> byte_len;
  std::optional<unsigned int> wc_flags;
  std::optional<uint32_t> imm_data;          // as posted (network order)
  std::optional<uint32_t> invalidated_rkey;  // host order
  std::optional<uint32_t> src_qp;
};
void ExpectWc(const ibv_wc& wc, const ExpectedWc& expected);

std::string Describe(const ibv_wc& wc);

#define SWIRL_ASSERT_OK(expr)                                  \
  do {                                                         \
    const ::absl::Status swirl_assert_ok_status = (expr);      \
    ASSERT_TRUE(swirl_assert_ok_status.ok())                   \
        << #expr << ": " << swirl_assert_ok_status.ToString(); \
  } while (0)

// ---- Fixture -----------------------------------------------------------------------------------

// Parameterized over the device name. Connect() makes a_ and b_: two QPs on separate contexts of
// the device under test, connected to each other and warmed up (WarmUp); a_ is the requester in
// most tests.
class DeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  const std::string& device() const { return GetParam(); }
  // The device's own name: device() without an "rdma-core:" prefix (transport/device.h), for
  // tests that know a device by its name (soft0, mlx5_0, rxe0).
  std::string device_name() const {
    absl::string_view name = device();
    absl::ConsumePrefix(&name, "rdma-core:");
    return std::string(name);
  }

  // Call as ASSERT_NO_FATAL_FAILURE(Connect(...)).
  void Connect(const EndpointOptions& a_options = {}, const EndpointOptions& b_options = {},
               const verbs::ConnectOptions& a_connect = DefaultConnectOptions(),
               const verbs::ConnectOptions& b_connect = DefaultConnectOptions());

  // A new endpoint on `pd` (or on a new context when `pd` is null), connected to a new endpoint
  // on a new context: {the new peer, the endpoint on pd}. For "another QP of the same PD".
  void ConnectExtra(const std::shared_ptr<verbs::ProtectionDomain>& pd,
                    std::unique_ptr<Endpoint>* peer, std::unique_ptr<Endpoint>* on_pd,
                    const EndpointOptions& options = {});

  // `n` new endpoints on `pd` with `receiver_options` (a shared receive CQ, an SRQ), each
  // connected to a new endpoint on a new context; appended to *receivers and *senders in order.
  // A new context of the device under test, a protection domain on it, and one receive CQ of
  // `cqe` entries that receivers share: `receiver_options->recv_cq`, for ConnectReceivers.
  void OpenReceiverSide(int cqe, std::shared_ptr<verbs::ProtectionDomain>* pd,
                        EndpointOptions* receiver_options);
  void ConnectReceivers(const std::shared_ptr<verbs::ProtectionDomain>& pd,
                        const EndpointOptions& receiver_options, int n,
                        std::vector<std::unique_ptr<Endpoint>>* senders,
                        std::vector<std::unique_ptr<Endpoint>>* receivers);

  DeviceFacts facts() const { return QueryFacts(a_->context()); }

  std::unique_ptr<Endpoint> a_;
  std::unique_ptr<Endpoint> b_;
};

}  // namespace swirl::conformance

#endif  // SWIRL_TRANSPORT_CONFORMANCE_CONFORMANCE_H_
