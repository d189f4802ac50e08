// Sanitizer suppressions for swirl's executables (tests, the servers tests start, examples)
// built with --config=asan or --config=tsan.
//
// Only findings inside system libraries that swirl cannot fix or rebuild belong here, each with
// the reason. Linked into executables only, never into libswirl: a library must not define
// these hooks for the programs that embed it.

extern "C" const char* __lsan_default_suppressions() {
  // gRPC's c-ares DNS resolver keeps a few small allocations (c-ares channel state) that gRPC
  // never frees before exit; 40 bytes once per process, not per connection.
  return "leak:libcares.so\n";
}

extern "C" const char* __tsan_default_suppressions() {
  // Debian's gRPC and Abseil are not built with ThreadSanitizer: TSan sees the system calls
  // and memory functions they call (epoll, eventfds, memcpy in absl::StrAppend or absl::Status,
  // memmove in absl::Mutex's deadlock graph) but not the synchronization around them (atomic
  // reference counts, absl::Mutex), and reports those as races. Checking stays on for all of
  // swirl's own code, which synchronizes through swirl::Mutex (base/mutex.h) and atomics.
  return "called_from_lib:libgrpc.so\n"
         "called_from_lib:libgpr.so\n"
         "called_from_lib:libgrpc++.so\n"
         "called_from_lib:libabsl_status.so\n"
         "called_from_lib:libabsl_statusor.so\n"
         "called_from_lib:libabsl_strings.so\n"
         "called_from_lib:libabsl_cord.so\n"
         "called_from_lib:libabsl_cord_internal.so\n"
         "called_from_lib:libabsl_synchronization.so\n"
         "called_from_lib:libabsl_graphcycles_internal.so\n"
         // OpenSSL (gRPC's TLS: the examples' --tls, examples/common/tls_e2e_test), which
         // synchronizes through its own locks and atomics, uninstrumented.
         "called_from_lib:libssl.so\n"
         "called_from_lib:libcrypto.so\n"
         // absl::BitGen's seed pool, filled under Abseil's own (uninstrumented) call_once and
         // spinlock on first use from any thread.
         "called_from_lib:libabsl_random_internal_pool_urbg.so\n"
         // Header code of theirs compiled into our binaries, synchronized by their uninstrumented
         // code: gRPC's thread pool queue (absl::AnyInvocable), absl::Status's reference count
         // (its last decrement happens inside libabsl_status).
         "race:grpc_event_engine\n"
         "race:grpc_core\n"
         "race:absl::debian3::Status::\n"
         "race:absl::debian3::Cord\n"
         // A flag's first read initializes it under Abseil's uninstrumented call_once
         // (FlagImpl::Init, then FlagImpl::Read in libabsl_flags_internal): two threads reading
         // one flag first at once (two channels opening their device) look like a race.
         "race:absl::debian3::flags_internal::FlagImpl\n"
         // The same for grpcpp's call operations (header templates compiled into our binaries):
         // a blocking call's status and message as it completes (a refused Connect's), and the
         // server's callback handlers (its health service) as they answer, both handed over by
         // gRPC's uninstrumented completion queues.
         "race:grpc::internal::CallOpSet\n";
}
