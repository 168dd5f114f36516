#pragma once
// The roofline report of `strata bench` (issue 18): achieved matmul GFLOP/s and weight GB/s per
// phase next to this machine's int8 dot-product peak and memory read bandwidth, both measured by
// probes in the same run (backend/cpu/kernels/peak_probe.h). docs/kernels.md ("Roofline").
#include <nlohmann/json.hpp>
#include <string>

namespace strata::cli {

/// The roofline of one bench run. `bench` is the run's JSON (threads, cpu_kernels, prompt_chunk,
/// prefill/decode with tokens and seconds). The work model is read from the GGUF at `model`:
/// matmul flops = 2 * (weights multiplied) per token, counting every 2-D weight except the
/// embedding table, expert tensors (name with "_exps", ne = [cols, rows, n_expert]) at
/// expert_used_count of expert_count per token, and the output head once per prompt and once
/// per decode token; attention scores are not counted. Weight bytes: decode reads the dense
/// weights and top-k experts per token; prefill reads the dense weights once per chunk and each
/// expert at most once per chunk (the expected distinct share for uniform routing). Returns
/// {peak: {int8_gops, int8_how, maddubs_gops, amx_int8_gops, read_gbps, threads}, prefill: {gflops,
/// gbps, pct_int8_peak, pct_amx_peak, pct_read}, decode: {...}} (amx_int8_gops: the AMX tile probe,
/// 0 without AMX; pct_amx_peak 0 then). Throws gguf::GgufError if the file cannot be read.
nlohmann::json bench_roofline(const std::string& model, const nlohmann::json& bench);

/// Prints the report of bench_roofline() as three lines (with AMX, one more per line: the tile peak).
void print_roofline(const nlohmann::json& roofline);

}  // namespace strata::cli
