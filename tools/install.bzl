"""swirl_dist: the tree `./swirl install --prefix DIR` copies (headers, libswirl.a/.so, plugin).

How the libraries are made (Bazel 4.2.3 has no cc_static_library, and a linkshared cc_binary
links its deps as archives without --whole-archive since --incompatible_remove_legacy_whole_archive
became the default, so it would come out empty):

  * This rule walks the CcInfo linking context of `deps` and takes, for every library that
    belongs to swirl's own repository, its PIC static archive (lib<name>.pic.a; Bazel builds it
    next to lib<name>.a in -c opt, and it is the only one in fastbuild). System libraries from
    @system carry only link flags, so they contribute flags, never code.
  * lib/libswirl.a: the members of those archives, each renamed after its package
    (rpc/libbulk.pic.a's bulk.pic.o becomes rpc_bulk.pic.o, so transport/device.o and
    transport/soft/device.o cannot collide), in one deterministic archive (`ar rcsD`).
  * lib/libswirl.so: the same archives linked with --whole-archive by the C++ toolchain's
    compiler, with -Wl,--no-undefined and the @system link flags (as needed), so the shared
    object records its own dependencies and a missing one fails the build, not the user.
  * include/swirl/: the public headers (`public_hdrs`, swirl's API in rpc/), as users include
    them: "swirl/channel.h". include/: the few other listed files (`hdrs`: the generated
    option header that users' generated code includes, and the .proto files) at their
    workspace paths. Nothing else: the engine's internal headers are never installed.
  * bin/protoc-gen-swirl: the protoc plugin.

Everything is an ordinary declared output under bazel-bin/<package>/<name>/, so the install step
is a plain recursive copy.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _install_path(f):
    # short_path is "rpc/server.h" for the main repository, "../swirl/rpc/server.h" when swirl
    # is an external repository; both install as "rpc/server.h".
    p = f.short_path
    if p.startswith("../"):
        p = p.split("/", 2)[2]
    return p

def _swirl_dist_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    own_repo = ctx.label.workspace_name

    archives = []
    link_flags = []
    for dep in ctx.attr.deps:
        for linker_input in dep[CcInfo].linking_context.linker_inputs.to_list():
            if linker_input.owner.workspace_name != own_repo:
                for flag in linker_input.user_link_flags:
                    if flag not in link_flags:
                        link_flags.append(flag)
                continue
            for lib in linker_input.libraries:
                archive = lib.pic_static_library
                if archive == None:
                    if lib.static_library != None:
                        fail("%s has no PIC archive; build with --force_pic" % linker_input.owner)
                    continue
                if archive not in archives:
                    archives.append(archive)

    out = ctx.attr.name + "/"
    static_lib = ctx.actions.declare_file(out + "lib/libswirl.a")
    shared_lib = ctx.actions.declare_file(out + "lib/libswirl.so")

    # libswirl.a: extract every archive into its own directory, prefix the members with the
    # archive's package, and archive them all again.
    merge = ctx.actions.args()
    merge.add(cc_toolchain.ar_executable)
    merge.add(static_lib)
    for a in archives:
        pkg = _install_path(a).rsplit("/", 1)
        merge.add(pkg[0].replace("/", "_") if len(pkg) == 2 else "top")
        merge.add(a)
    ctx.actions.run_shell(
        inputs = depset(archives, transitive = [cc_toolchain.all_files]),
        outputs = [static_lib],
        arguments = [merge],
        command = """set -eu
ar="$1"; out="$PWD/$2"; shift 2
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
n=0
while [ $# -gt 0 ]; do
  n=$((n + 1)); prefix="$1"; archive="$PWD/$2"; shift 2
  mkdir "$work/$n"
  (cd "$work/$n" && "$ar" x "$archive" && for o in *; do mv "$o" "${prefix}_$o"; done)
done
rm -f "$out"
"$ar" rcsD "$out" "$work"/*/*
""",
        use_default_shell_env = True,
        mnemonic = "SwirlArchive",
        progress_message = "Archiving libswirl.a",
    )

    link = ctx.actions.args()
    link.add("-shared")
    link.add("-o", shared_lib)
    link.add("-Wl,-soname,libswirl.so")
    link.add("-Wl,--no-undefined")
    link.add("-Wl,--whole-archive")
    link.add_all(archives)
    link.add("-Wl,--no-whole-archive")
    link.add("-Wl,--as-needed")
    link.add_all(link_flags)
    link.add_all(ctx.fragments.cpp.linkopts)  # --linkopt, e.g. the sanitizers of --config=asan
    link.add_all(["-lstdc++", "-lm"])
    ctx.actions.run(
        executable = cc_toolchain.compiler_executable,
        inputs = depset(archives, transitive = [cc_toolchain.all_files]),
        outputs = [shared_lib],
        arguments = [link],
        use_default_shell_env = True,  # PATH, so that gcc finds ld as in Bazel's own links
        mnemonic = "SwirlSharedLink",
        progress_message = "Linking libswirl.so",
    )

    outputs = [static_lib, shared_lib]
    copies = []
    for hdr in ctx.files.hdrs:
        dest = ctx.actions.declare_file(out + "include/" + _install_path(hdr))
        outputs.append(dest)
        copies.append((hdr, dest))
    for hdr in ctx.files.public_hdrs:
        dest = ctx.actions.declare_file(out + "include/swirl/" + hdr.basename)
        outputs.append(dest)
        copies.append((hdr, dest))
    plugin = ctx.executable.plugin
    plugin_dest = ctx.actions.declare_file(out + "bin/" + plugin.basename)
    outputs.append(plugin_dest)
    copies.append((plugin, plugin_dest))
    for lib in ctx.files.preload_libs:
        lib_dest = ctx.actions.declare_file(out + "lib/" + lib.basename)
        outputs.append(lib_dest)
        copies.append((lib, lib_dest))

    # Copies, then checks that the installed headers are closed under #include "...": each one
    # they name is installed too or a system header (/usr/include), so that a public header
    # that starts including an unlisted one fails here, not in a user's build.
    copy = ctx.actions.args()
    copy.add(static_lib.dirname[:-len("lib")] + "include")
    for src, dest in copies:
        copy.add(src)
        copy.add(dest)
    ctx.actions.run_shell(
        inputs = [src for src, _ in copies],
        outputs = [dest for _, dest in copies],
        arguments = [copy],
        command = """set -eu
include="$1"; shift
while [ $# -gt 0 ]; do cp -f "$1" "$2"; shift 2; done
missing="$(cd "$include" && find . -name '*.h' | sort | while read -r h; do
  sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\\([^"]*\\)".*/\\1/p' "$h" |
    while read -r i; do
      [ -f "$i" ] || [ -f "/usr/include/$i" ] || echo "  ${h#./} includes \"$i\""
    done
done)"
if [ -n "$missing" ]; then
  echo "swirl_dist: installed headers include headers that are not installed:" >&2
  echo "$missing" >&2
  echo "public headers include only the standard library, Abseil and swirl/ headers" >&2
  exit 1
fi
""",
        mnemonic = "SwirlDistHeaders",
        progress_message = "Collecting swirl's public headers",
    )

    # What include/ holds, one path a line: the install copies these, never what a directory
    # listing finds (bazel-out keeps files an older version of this rule declared).
    manifest = ctx.actions.declare_file(out + "include.list")
    include_prefix = out + "include/"
    ctx.actions.write(manifest, "".join([
        dest.short_path.split(include_prefix, 1)[1] + "\n"
        for _, dest in copies
        if include_prefix in dest.short_path
    ]))
    outputs.append(manifest)

    return [DefaultInfo(files = depset(outputs))]

swirl_dist = rule(
    implementation = _swirl_dist_impl,
    attrs = {
        "deps": attr.label_list(
            providers = [CcInfo],
            doc = "swirl's libraries; everything of swirl's own repository below them goes in",
        ),
        "hdrs": attr.label_list(
            allow_files = True,
            doc = "installed under include/ at their workspace paths",
        ),
        "public_hdrs": attr.label_list(
            allow_files = [".h"],
            doc = "swirl's public headers, installed as include/swirl/<file name>",
        ),
        "plugin": attr.label(executable = True, cfg = "target", mandatory = True),
        "preload_libs": attr.label_list(
            allow_files = [".so"],
            doc = "shared libraries installed as they are under lib/ (LD_PRELOAD libraries)",
        ),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
)
