#!/bin/sh
echo "swirl: bazel coverage is not available offline (remote_coverage_tools stand-in)" >&2
exit 1
