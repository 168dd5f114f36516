#pragma once
// Quality measurements of a run against the text or against a reference run: perplexity,
// KL divergence from a compact reference file, and the statistics printed with them
// (`strata perplexity`, docs/tools.md). Plain functions over logits, so every formula can be
// checked on hand-computed inputs (tests/test_quality.cpp); only the MoCE calibration at the
// end drives an engine.
//
// Conventions (llama.cpp's tools/perplexity/perplexity.cpp, so numbers are comparable):
//  - the text's tokens are cut into n_chunk = n_tokens / n_ctx chunks of n_ctx tokens (the
//    rest is dropped); each chunk runs from an empty KV cache;
//  - in each chunk only the second half is scored: the logits at positions j in
//    [first, n_ctx - 1) with first = n_ctx / 2 predict token j + 1, so n_ctx - 1 - first
//    tokens per chunk, each with at least first tokens of context;
//  - NLL of a position = -log softmax(logits)[next token]; PPL = exp(mean NLL).
#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

namespace strata::quality {

/// Thrown for inputs a quality measurement cannot use: a text shorter than two chunks, a base
/// file that is truncated, corrupt, of another version, or from another text, tokenizer or
/// vocabulary. The message says which and what to do.
class QualityError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// How a text of n_tokens is cut and scored with chunks of n_ctx tokens.
struct ChunkPlan {
  int n_ctx = 0;     ///< tokens per chunk
  int n_chunk = 0;   ///< n_tokens / n_ctx (llama.cpp needs at least 2)
  int first = 0;     ///< n_ctx / 2: the first position whose logits are scored
  int n_scored = 0;  ///< n_ctx - 1 - first scored positions per chunk
};
/// The llama.cpp plan. Throws QualityError when n_ctx < 4 or n_tokens < 2 * n_ctx (naming
/// both counts, as llama-perplexity refuses such a text).
ChunkPlan plan_chunks(size_t n_tokens, int n_ctx);

/// Mean of n samples given their sum and sum of squares, and its standard error
/// sqrt((sum2/n - mean^2) / (n - 1)) (the population variance over n - 1, as llama.cpp
/// computes it; equal to the sample standard deviation / sqrt(n)). error = 0 when n < 2 or the
/// variance rounds to <= 0.
struct MeanError {
  double mean = 0;
  double error = 0;
};
MeanError mean_and_error(double sum, double sum2, size_t n);

/// The `fraction` quantile (0..1) of ascending `sorted` by linear interpolation between the
/// two closest ranks, rank = fraction * (n - 1) (numpy's default "linear" method, the one
/// llama.cpp uses). Throws std::invalid_argument on an empty input.
double percentile(std::span<const double> sorted, double fraction);

/// log(sum_i exp(row[i])) in double: max in float, sum of exp(row[i] - max) in index order.
double log_sum_exp(const float* row, int n_vocab);
/// The log-probability of a logit as stored and compared everywhere: float(logit - lse). One
/// definition so that a run compared with its own base gives exactly 0.
inline float log_prob(float logit, double lse) { return float(double(logit) - lse); }

/// What the base file keeps of one scored position of the reference run P:
///  - lse: log-sum-exp of its logits (nats; logits = log-probs + lse);
///  - ids/lp: the K most probable token ids by descending logit (ties: lower id first) and
///    their log-probs log P(i) (float, log_prob above);
///  - tail: P's mass outside those K ids, sum_{i not in top K} P(i), summed in double over the
///    full distribution (not 1 - sum of the K: that would lose everything below 1e-7);
///  - next_lp: log P(next), the log-prob of the text's next token (in top K or not), for PPL(base)
///    and Δp of the text token.
struct RefPosition {
  double lse = 0;
  double tail = 0;
  float next_lp = 0;
  std::vector<int32_t> ids;
  std::vector<float> lp;
};
/// The record of one position from its full logits. K in [1, n_vocab]; next_id in [0, n_vocab).
RefPosition make_ref(const float* row, int n_vocab, int top_k, int32_t next_id);

/// One position of a run Q compared with its reference P.
///  kld: KL(P || Q) over the K + 1 bins {top-K ids of P, everything else}:
///         sum_{i in S} P(i) (log P(i) - log Q(i)) + P_T log(P_T / Q_T),
///       P_T = P's tail, Q_T = Q's mass outside S. By the log-sum inequality the true tail
///       term sum_{i not in S} P(i) log(P(i)/Q(i)) >= P_T log(P_T/Q_T), so this is a LOWER
///       bound of the true KL(P||Q), exact when K = n_vocab (tail empty). It is the KLD reported.
///  kld_upper: an UPPER bound: the exact S part plus the largest tail term any distribution
///       consistent with what was stored can give: every tail P(i) is at most P(K-th id) (it
///       is not in the top K) and they sum to P_T; the term is convex in P, so its maximum puts
///       P(K-th) on the tail ids of smallest Q(i), the remainder on the next.
///  nll, nll_base: -log Q(next), -next_lp.  same_top: Q's argmax (lower id on ties) == P's top id.
///  dp_text: Q(next) - P(next) (llama.cpp's Δp);  dp_top: Q(top) - P(top) for P's top-1 id.
struct PositionCompare {
  double kld = 0;
  double kld_upper = 0;
  double nll = 0;
  double nll_base = 0;
  bool same_top = false;
  double dp_text = 0;
  double dp_top = 0;
  double tail = 0;  ///< P's mass outside its top K (what the bounds are about)
};
PositionCompare compare_position(const RefPosition& ref, const float* row, int n_vocab, int32_t next_id);

/// Perplexity over a set of NLLs: PPL = exp(mean), error = PPL * SE(mean NLL) (first-order
/// propagation through exp, as llama.cpp prints "PPL = x +/- y").
struct PplAccumulator {
  double sum = 0, sum2 = 0;
  size_t n = 0;
  void add(double nll) {
    sum += nll;
    sum2 += nll * nll;
    ++n;
  }
  MeanError nll() const { return mean_and_error(sum, sum2, n); }
  double ppl() const { return n ? std::exp(sum / double(n)) : 0.0; }
  double ppl_error() const { return ppl() * nll().error; }
};

/// The summary `strata perplexity --kl-divergence` prints (all over the scored positions).
struct KldSummary {
  size_t n = 0;
  MeanError ppl, ppl_base;    ///< PPL(Q), PPL(P) with their errors (as PplAccumulator)
  MeanError ppl_ratio;        ///< exp(mean(nll - nll_base)), error ratio * SE(mean difference)
  MeanError kld;              ///< mean lower-bound KLD and its SE
  double kld_upper_mean = 0;  ///< mean of kld_upper (the gap to kld is what top-K can not see)
  double tail_mean = 0;       ///< mean of P's tail mass
  double kld_p99 = 0, kld_p999 = 0, kld_max = 0, kld_median = 0;
  MeanError same_top;     ///< fraction p, error sqrt(p (1 - p) / (n - 1))
  MeanError rms_dp_text;  ///< sqrt(mean dp^2), error 0.5 / rms * SE(mean dp^2)
  MeanError rms_dp_top;
};
KldSummary summarize(std::span<const PositionCompare> positions);

/// The reference run, as `--kl-divergence-base FILE` writes it (format in docs/tools.md):
/// version, vocabulary size, K, chunk plan, a hash of the tokenizer, the model file and
/// settings it came from, every evaluated token, then one RefPosition per scored position
/// (n_chunk * n_scored, chunk by chunk), and a 64-bit FNV-1a checksum of all preceding bytes.
struct KldBase {
  static constexpr uint32_t kVersion = 1;
  uint32_t n_vocab = 0;
  uint32_t top_k = 0;
  ChunkPlan plan;
  uint64_t tokenizer_hash = 0;
  std::string model;            ///< the reference model file (as given)
  std::string settings;         ///< the reference engine settings, for the report (e.g. "act-quant f32, kernels avx2")
  std::vector<int32_t> tokens;  ///< n_chunk * n_ctx: the tokens the chunks ran
  std::vector<RefPosition> positions;
};
/// Writes `base` to `path` (via path.tmp, renamed when complete). Throws QualityError when
/// the file can not be written or the sizes are inconsistent.
void write_kld_base(const std::string& path, const KldBase& base);
/// Reads and validates a base file. Throws QualityError naming the problem: not a base file
/// (magic), another version, truncated (expected vs actual bytes), corrupt (checksum).
KldBase read_kld_base(const std::string& path);

/// 64-bit FNV-1a of n bytes, continuing from h.
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull);
/// A tokenizer's identity: FNV-1a over the pre-tokenizer name, then every token's bytes and
/// type in id order. Two tokenizers that can encode a text differently hash differently.
uint64_t tokenizer_hash(const tokenizer::Tokenizer& tok);

// ---- MoCE calibration (--moce-kld-budget; docs/tools.md, "MoCE") ----

/// The prompt of the built-in calibration sample (the model's own greedy text after it).
inline constexpr const char* kMoceCalibrationPrompt = "def fibonacci(n):";

/// Exact mean KL(p || q) in nats over rows of log-probabilities p_log, q_log ([n][n_vocab],
/// n_vocab contiguous; both log-softmax). Throws std::invalid_argument on mismatched sizes.
double mean_kld_rows(std::span<const float> p_log, std::span<const float> q_log, int n_vocab);

/// A grid point of the calibration: the bonus and its teacher-forced mean KLD vs bonus 0.
struct MoceGridPoint {
  float bonus = 0;
  double kld = 0;
  uint64_t misses = 0;  ///< decode misses of the run
};
struct MoceCalibration {
  float bonus = 0;  ///< the largest grid bonus whose KLD <= budget (0 if none)
  double kld = 0;   ///< its KLD (0 for bonus 0)
  std::vector<MoceGridPoint> grid;
};

/// Log-softmax rows of `tokens` fed one at a time through Engine::decode on a fresh sequence
/// (teacher forcing), at the engine's current bonus, from an empty arena ([n][n_vocab]).
/// Throws EngineError as decode does (e.g. more tokens than the context).
std::vector<float> teacher_forced_logprobs(engine::Engine& eng, std::span<const int32_t> tokens);

/// `n` greedy tokens after kMoceCalibrationPrompt at bonus 0 (prompt included, at most the context).
std::vector<int32_t> moce_builtin_sample(engine::Engine& eng, int n);

/// Grid search (the grid is kMoceGrid, ascending): every point's teacher-forced mean KLD against
/// bonus 0 over `tokens`; chooses the largest bonus whose KLD <= budget. Leaves the engine at
/// the chosen bonus, its arena empty and its counters reset. Throws std::invalid_argument for a
/// budget that is not > 0 and finite, EngineError as decode does.
MoceCalibration calibrate_moce(engine::Engine& eng, std::span<const int32_t> tokens, double budget);
inline constexpr float kMoceGrid[] = {0.05f, 0.1f, 0.15f, 0.25f, 0.35f, 0.5f, 0.65f, 0.85f, 1.0f};

}  // namespace strata::quality
