#include "absl/flags/flag.h"
#include "examples/common/tls_flags.h"

ABSL_FLAG(std::string, tls_ca, "",
          "TLS for the control plane: the CA that signed the server's certificate (PEM file)");
ABSL_FLAG(std::string, tls_target_name, "",
          "the name to check in the server's certificate (default: the host of --server)");
ABSL_FLAG(std::string, tls_cert, "", "mutual TLS: this client's certificate (PEM file)");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: this client's private key (PEM file)");

namespace swirl::examples {

void ApplyTlsFlags(ChannelOptions& options) {
  options.tls_root_cert_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_target_name = absl::GetFlag(FLAGS_tls_target_name);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
}

}  // namespace swirl::examples
