#include "rpc/outbox.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "base/log.h"
#include "transport/verbs/status.h"

namespace swirl::internal {
namespace {

using rpc_wire::MessageHeader;

constexpr uint32_t kHeader = sizeof(MessageHeader);

}  // namespace

absl::Status Outbox::Init(const std::shared_ptr<verbs::ProtectionDomain>& pd, const Config& config,
                          absl::AnyInvocable<void(Connection*, const absl::Status&)> fail) {
  auto pool = BufferPool::Create(pd, config.send_buffers, config.buffer_size, 0);
  if (!pool.ok()) return pool.status();
  pool_ = std::move(*pool);
  pool_lkey_ = pool_->lkey();
  max_inline_ = config.max_inline;
  slot_size_ = std::max<uint32_t>(max_inline_, 64);
  park_share_ = config.park_share;
  arena_.resize(static_cast<size_t>(kArenaSlots) * slot_size_);
  fail_ = std::move(fail);
  return absl::OkStatus();
}

uint64_t Outbox::QueueRaw(Connection* c, const ibv_send_wr& wr, const ibv_sge* sge, int32_t op) {
  SendQueue& sends = c->sends();
  ibv_send_wr& out = sends.next_wr();
  out = wr;
  if (sge != nullptr) {
    ibv_sge& slot = sends.next_sge();
    slot = *sge;
    out.sg_list = &slot;
    out.num_sge = 1;
  } else {
    out.sg_list = nullptr;
    out.num_sge = 0;
  }
  return Commit(c, -1, op);
}

void Outbox::EmitSlow(Connection* c, char* data, uint32_t length, int32_t buffer,
                      uint32_t invalidate_rkey, unsigned int flags) {
  if (c->closing()) {
    // Failed already (possibly by a step of the operation that is emitting this): nothing will
    // send or give back what is parked from now on.
    Give(buffer);
    return;
  }
  CreditLedger& credits = c->credits();
  if (!credits.MustPark()) {
    Queue(c, data, length, buffer, invalidate_rkey, flags);
    return;
  }
  // Parking is bounded per connection, as the send pool is shared by all of the worker's: its
  // share of the pool, and at least four messages per credit we grant. An honest peer stays far
  // below that: it may send only while we return credits, which travel only on what we send, so
  // while we park it can add at most one credit window of requests, each owed a response and
  // perhaps a grant or an ack (e2e_test: a caller that starts 2,000 calls without polling is
  // slowed, not shed). A peer over the bound is not taking our messages yet keeps finding a
  // way to make more; it is shed, saying why, before the pool runs dry for everyone.
  const size_t max_parked = std::max<size_t>(4 * size_t{credits.local_grant()}, park_share_);
  if (credits.parked() >= max_parked) {
    Give(buffer);
    SWIRL_LOG(WARNING, "connection %u (%s): %u messages wait for credits the peer does not "
              "return; closing it", c->id(), c->peer(), credits.parked());
    fail_(c, absl::ResourceExhaustedError(absl::StrFormat(
                 "%u messages waited for credits the peer did not return", credits.parked())));
    return;
  }
  if (buffer < 0) {  // an inline slot is reused at the next doorbell: into a send buffer
    if (pool_->empty()) {
      fail_(c, absl::ResourceExhaustedError("send buffers exhausted"));
      return;
    }
    const uint32_t index = pool_->Take();
    std::memcpy(pool_->at(index), data, length);
    buffer = static_cast<int32_t>(index);
  }
  credits.Park({static_cast<uint32_t>(buffer), length, invalidate_rkey, flags});
}

void Outbox::SendControl(Connection* c, rpc_wire::MessageType type, uint64_t request_id) {
  if (!c->credits().CanSend()) return;
  int32_t buffer;
  char* data = Alloc(kHeader, &buffer);
  if (data == nullptr) return;
  *reinterpret_cast<MessageHeader*>(data) = MessageHeader{
      .version = rpc_wire::kProtocolVersion,
      .type = static_cast<uint8_t>(type),
      .request_id = request_id,
  };
  Queue(c, data, kHeader, buffer);
}

bool Outbox::Unpark(Connection* c) {
  ParkedMessage m;
  while (c->credits().Unpark(&m)) {
    Queue(c, pool_->at(m.buffer), m.length, static_cast<int32_t>(m.buffer), m.invalidate_rkey,
          m.flags);
  }
  return c->credits().parked() == 0;
}

void Outbox::PostFailed(Connection* c, int err) {
  fail_(c, verbs::VerbsError("ibv_post_send", err));
}

void Outbox::DropUnsent(Connection* c) {
  for (const ParkedMessage& m : c->credits().TakeParked()) pool_->Give(m.buffer);
  c->sends().DropUnposted([this](int32_t buffer) { Give(buffer); });
}

void Outbox::Forget(Connection* c) {
  if (c->in_doorbell_list) {
    doorbells_.erase(std::remove(doorbells_.begin(), doorbells_.end(), c), doorbells_.end());
    c->in_doorbell_list = false;
  }
  DropUnsent(c);
  c->sends().ForgetOutstanding([this](int32_t buffer) { Give(buffer); });
}

}  // namespace swirl::internal
