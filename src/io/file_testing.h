#pragma once
// Test hook for io::File (not for production code). Some filesystems accept O_DIRECT at
// open and fail the first read with EINVAL; no filesystem on a CI machine is guaranteed
// to do that, so tests can make File::open's probe read behave as if it had.
namespace strata::io::testing {

/// While set, File::open treats its O_DIRECT probe read as failed with EINVAL (so it
/// falls back to buffered reads and warns, exactly as on such a filesystem).
void simulate_direct_read_einval(bool on);

}  // namespace strata::io::testing
