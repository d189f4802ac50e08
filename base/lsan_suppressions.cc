// LeakSanitizer suppressions for test binaries built with --config=asan.
//
// Only leaks inside system libraries that swirl cannot fix belong here, each with the reason.
// Linked into tests (testonly), never into libswirl: a library must not define this hook for
// the programs that embed it.

extern "C" const char* __lsan_default_suppressions() {
  // gRPC's c-ares DNS resolver keeps a few small allocations (c-ares channel state) that gRPC
  // never frees before exit; 40 bytes once per process, not per connection.
  return "leak:libcares.so\n";
}
