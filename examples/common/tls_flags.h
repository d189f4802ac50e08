// The examples' TLS flags, applied to their options. A server links :server_tls_flags and gets
//   --tls_cert, --tls_key  the control plane's certificate and key (PEM files; none: plaintext)
//   --tls_client_ca        mutual TLS: clients must present a certificate this CA signed
// a client links :client_tls_flags and gets
//   --tls_ca               the CA that signed the server's certificate (none: plaintext)
//   --tls_target_name      the name to check in the server's certificate instead of the host
//   --tls_cert, --tls_key  a client certificate, for a server that asks for one

#ifndef SWIRL_EXAMPLES_COMMON_TLS_FLAGS_H_
#define SWIRL_EXAMPLES_COMMON_TLS_FLAGS_H_

#include "swirl/channel.h"
#include "swirl/server.h"

namespace swirl::examples {

void ApplyTlsFlags(ServerOptions& options);   // in :server_tls_flags
void ApplyTlsFlags(ChannelOptions& options);  // in :client_tls_flags

}  // namespace swirl::examples

#endif  // SWIRL_EXAMPLES_COMMON_TLS_FLAGS_H_
