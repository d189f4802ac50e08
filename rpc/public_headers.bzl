"""swirl's public headers: the files in rpc/ that users include as "swirl/<name>.h".

One list for the two places that need it: //rpc:api (include_prefix "swirl") and //:swirl_dist,
which installs exactly these under include/swirl/. They include only the standard library,
Abseil and each other (swirl_dist checks it, and tools/embedding_check.sh compiles each alone).
"""

PUBLIC_HDRS = [
    "bulk.h",
    "call.h",
    "channel.h",
    "client_runtime.h",
    "method_id.h",
    "server.h",
    "service.h",
    "stats.h",
    "transport_options.h",
]
