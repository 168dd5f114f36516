#include "cli/bench_roofline.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "backend/cpu/kernels/kernels.h"
#include "backend/cpu/kernels/peak_probe.h"
#include "cli/common.h"
#include "gguf/gguf.h"

namespace strata::cli {

nlohmann::json bench_roofline(const std::string& model, const nlohmann::json& bench) {
  const gguf::File file = gguf::File::open(model);
  const std::string arch = file.get_string("general.architecture", "");
  const double n_expert = double(file.get_int(arch + ".expert_count", 0));
  const double top_k = double(file.get_int(arch + ".expert_used_count", 0));
  // per token: multiply-adds of the dense weights, of the top-k experts, of the output head;
  // bytes of the dense weights and of all experts
  double dense_mac = 0, expert_mac = 0, head_mac = 0, dense_bytes = 0, expert_bytes = 0;
  for (const gguf::TensorInfo& t : file.tensors()) {
    if (t.ne.size() < 2 || t.ne[1] <= 1 || t.name.rfind("token_embd", 0) == 0) continue;
    const double mac = double(t.ne[0]) * double(t.ne[1]);
    if (t.name.find("_exps") != std::string::npos && t.ne.size() >= 3 && n_expert > 0) {
      expert_mac += mac * top_k;
      expert_bytes += double(t.n_bytes);
    } else if (t.name.rfind("output.", 0) == 0) {
      head_mac += mac;
      dense_bytes += double(t.n_bytes);
    } else {
      dense_mac += mac;
      dense_bytes += double(t.n_bytes);
    }
  }
  const int threads = std::max(1, bench.value("threads", 1));
  const std::string fam = bench.value("cpu_kernels", std::string("auto"));
  cpu::kernels::CpuKernels family = cpu::kernels::CpuKernels::Scalar;
  try {
    family = cpu::kernels::resolve_kernels(cpu::kernels::parse_cpu_kernels(fam)).family;
  } catch (const std::exception&) {  // a backend without CPU kernels: probe what the CPU has
    family = cpu::kernels::resolve_kernels().family;
  }
  const cpu::kernels::PeakProbe p = cpu::kernels::probe_peak(family, threads);
  nlohmann::json out = {{"peak",
                         {{"int8_gops", p.int8_gops},
                          {"int8_how", p.int8_how},
                          {"maddubs_gops", p.maddubs_gops},
                          {"amx_int8_gops", p.amx_int8_gops},
                          {"read_gbps", p.read_gbps},
                          {"threads", p.threads}}}};
  for (const char* name : {"prefill", "decode"}) {
    const nlohmann::json& ph = bench.value(name, nlohmann::json::object());
    const double tokens = double(ph.value("tokens", int64_t(0))), seconds = ph.value("seconds", 0.0);
    if (tokens <= 0 || seconds <= 0) continue;
    const bool pre = std::string(name) == "prefill";
    double chunk = double(bench.value("prompt_chunk", 0));
    if (!pre || chunk <= 0 || chunk > tokens) chunk = pre ? tokens : 1;
    const double chunks = std::ceil(tokens / chunk);
    const double mac = tokens * (dense_mac + expert_mac) + (pre ? 1 : tokens) * head_mac;
    // expected share of the experts a chunk of `chunk` tokens routes to (uniform routing)
    const double used = n_expert > 0 ? 1.0 - std::pow(1.0 - top_k / n_expert, chunk) : 0.0;
    const double bytes = chunks * (dense_bytes + used * expert_bytes);
    const double gflops = 2 * mac / seconds / 1e9, gbps = bytes / seconds / 1e9;
    out[name] = {{"gflops", gflops},
                 {"gbps", gbps},
                 {"pct_int8_peak", p.int8_gops > 0 ? 100 * gflops / p.int8_gops : 0.0},
                 {"pct_amx_peak", p.amx_int8_gops > 0 ? 100 * gflops / p.amx_int8_gops : 0.0},
                 {"pct_read", p.read_gbps > 0 ? 100 * gbps / p.read_gbps : 0.0}};
  }
  return out;
}

void print_roofline(const nlohmann::json& r) {
  const auto& p = r["peak"];
  const bool int8 = p["int8_gops"].get<double>() > 0;  // the scalar kernels have no int8 SIMD peak
  if (int8)
    fmt::print("roofline: int8 peak {:.1f} GOPS ({}, {}; bare vpmaddubsw {:.1f}), memory read {:.1f} GB/s\n",
               p["int8_gops"].get<double>(), p["int8_how"].get<std::string>(),
               count_of(p["threads"].get<int>(), "thread"), p["maddubs_gops"].get<double>(),
               p["read_gbps"].get<double>());
  else
    fmt::print("roofline: int8 peak n/a (scalar kernels), memory read {:.1f} GB/s ({})\n", p["read_gbps"].get<double>(),
               count_of(p["threads"].get<int>(), "thread"));
  const double amx = p.value("amx_int8_gops", 0.0);
  if (amx > 0) fmt::print("roofline: AMX int8 tile peak {:.1f} GOPS (tdpbssd 16x16x64)\n", amx);
  for (const char* name : {"prefill", "decode"}) {
    if (!r.contains(name)) continue;
    const auto& j = r[name];
    const std::string share =
        int8 ? fmt::format(" ({:.0f} % of the int8 peak{})", j["pct_int8_peak"].get<double>(),
                           amx > 0 ? fmt::format(", {:.1f} % of the AMX tile peak", j.value("pct_amx_peak", 0.0))
                                   : std::string())
             : std::string();
    fmt::print("{:<8} matmul {:.1f} GFLOP/s{}, weights {:.2f} GB/s ({:.0f} % of the memory read probe)\n", name,
               j["gflops"].get<double>(), share, j["gbps"].get<double>(), j["pct_read"].get<double>());
  }
}

}  // namespace strata::cli
