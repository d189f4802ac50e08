#include "absl/flags/flag.h"
#include "examples/common/tls_flags.h"

ABSL_FLAG(std::string, tls_cert, "", "TLS certificate (PEM file) for the control plane");
ABSL_FLAG(std::string, tls_key, "", "TLS private key (PEM file) for the control plane");
ABSL_FLAG(std::string, tls_client_ca, "",
          "mutual TLS: clients must present a certificate signed by this CA (PEM file)");

namespace swirl::examples {

void ApplyTlsFlags(ServerOptions& options) {
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
}

}  // namespace swirl::examples
