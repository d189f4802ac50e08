// What the two fabrics share: which one a GID names, and which one a device opens on.

#include "transport/soft/fabric.h"

#include <cerrno>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "transport/soft/soft_device.h"

namespace swirl::soft {

Fabric::Kind Fabric::KindOfGid(const ibv_gid& gid) {
  return IsTcpFabricGid(gid) ? Kind::kTcp : Kind::kSharedMemory;
}

const char* Fabric::Describe(Kind kind) {
  return kind == Kind::kTcp ? "TCP (SWIRL_SOFT_TCP)" : "shared memory";
}

int Fabric::CheckReachable(const std::string& device, const ibv_gid& local,
                           const ibv_gid& remote, std::string* why) {
  const Kind local_kind = KindOfGid(local);
  const Kind remote_kind = KindOfGid(remote);
  if (local_kind == remote_kind) return 0;
  *why = absl::StrCat("the peer's soft device is on ", Describe(remote_kind), " and ", device,
                      " on ", Describe(local_kind),
                      ": set SWIRL_SOFT_TCP on both ends or on neither");
  return EHOSTUNREACH;
}

std::unique_ptr<Fabric> OpenFabric(Hca* hca, std::string* error) {
  if (const char* env = std::getenv("SWIRL_SOFT_TCP"); env != nullptr && *env != 0) {
    return TcpFabric::Open(hca, env, error);
  }
  return ShmFabric::Open(hca, error);
}

}  // namespace swirl::soft
