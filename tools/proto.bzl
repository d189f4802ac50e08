"""swirl_proto_library: C++ (and optionally gRPC and swirl) code from .proto files, offline.

Uses the system protoc and grpc_cpp_plugin from Debian (no rules_proto download) and swirl's own
protoc plugin, //tools/protoc-gen-swirl, for typed swirl service bases and client stubs.

    swirl_proto_library(
        name = "echo_proto",
        srcs = ["echo.proto"],
        deps = [":other_proto"],   # other swirl_proto_library targets, in any repository;
                                   # "@swirl//proto:options_proto" to import
                                   # "proto/options.proto" ((swirl.blocking), (swirl.one_way))
        grpc = False,              # also generate gRPC stubs (foo.grpc.pb.{h,cc})
        swirl = True,              # also generate swirl stubs (foo.swirl.{h,cc})
    )

Include the results as "<package>/foo.pb.h", "<package>/foo.swirl.h".
"""

load("//tools:copts.bzl", "GENERATED_COPTS")

# Labels of swirl's own targets, resolved in swirl's repository even when a macro call sits in
# another workspace.
_SWIRL_RPC = str(Label("//rpc:rpc"))
_SWIRL_PLUGIN = str(Label("//tools/protoc-gen-swirl:protoc-gen-swirl"))

# Where swirl's own .proto files sit in the execroot ("" inside swirl, "external/<name>" when
# swirl is another workspace's dependency): proto/options.proto is imported by that path.
_SWIRL_ROOT = Label("//proto:options_proto").workspace_root

def _workspace_root():
    repo = native.repository_name()
    return "" if repo == "@" else "external/" + repo[1:]

def _normalize(dep):
    # "//a/b" and "@r//a/b" mean ":b" of that package: spelled out, so "_protos" can be appended.
    if dep.startswith(":"):
        return dep
    path = dep[dep.find("//") + 2:]
    return dep if ":" in path else dep + ":" + path.split("/")[-1]

def _dep_root(dep, own_root):
    # The execroot directory a dependency's .proto files are imported from.
    if dep.startswith("@") and not dep.startswith("@//"):
        return "external/" + dep[1:dep.find("//")]
    return own_root

def swirl_proto_library(name, srcs, deps = [], grpc = False, swirl = True, visibility = None):
    root = _workspace_root()
    pkg = native.package_name()
    bases = [s[:-len(".proto")] for s in srcs]
    outs = []
    for b in bases:
        outs += [b + ".pb.h", b + ".pb.cc"]
        if grpc:
            outs += [b + ".grpc.pb.h", b + ".grpc.pb.cc"]
        if swirl:
            outs += [b + ".swirl.h", b + ".swirl.cc"]

    deps = [_normalize(d) for d in deps]
    native.filegroup(
        name = name + "_protos",
        srcs = srcs + [d + "_protos" for d in deps],
        visibility = visibility,
    )

    out_dir = "$(GENDIR)" + ("/" + root if root else "")
    # Import roots: this workspace's, each dependency's, and swirl's (for proto/options.proto).
    roots = [root]
    for r in [_dep_root(d, root) for d in deps] + [_SWIRL_ROOT]:
        if r not in roots:
            roots.append(r)
    tools = ["@system//:protoc"]
    cmd = "$(location @system//:protoc)"
    for r in roots:
        cmd += " -I" + (r if r else ".")
    cmd += " -I/usr/include"
    cmd += " --cpp_out=" + out_dir
    if grpc:
        tools.append("@system//:grpc_cpp_plugin")
        cmd += " --plugin=protoc-gen-grpc=$(location @system//:grpc_cpp_plugin)"
        cmd += " --grpc_out=" + out_dir
    if swirl:
        tools.append(_SWIRL_PLUGIN)
        cmd += " --plugin=protoc-gen-swirl=$(location " + _SWIRL_PLUGIN + ")"
        cmd += " --swirl_out=" + out_dir
    cmd += " " + " ".join([(root + "/" if root else "") + (pkg + "/" if pkg else "") + s for s in srcs])

    native.genrule(
        name = name + "_gen",
        srcs = [name + "_protos"],
        outs = outs,
        cmd = cmd,
        tools = tools,
        message = "protoc " + " ".join(srcs),
    )

    cc_deps = list(deps) + ["@system//:protobuf"]
    if grpc:
        cc_deps.append("@system//:grpc")
    if swirl:
        cc_deps.append(_SWIRL_RPC)
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        copts = GENERATED_COPTS,
        deps = cc_deps,
        visibility = visibility,
    )
