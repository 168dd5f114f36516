#include "engine/quality.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "engine/sampler.h"

namespace strata::quality {

ChunkPlan plan_chunks(size_t n_tokens, int n_ctx) {
  if (n_ctx < 4) throw QualityError(fmt::format("chunk size -c {} is too small: use at least 4 tokens", n_ctx));
  if (n_tokens < 2 * size_t(n_ctx))
    throw QualityError(fmt::format(
        "the text has {} tokens; perplexity with chunks of {} (-c) needs at least 2 chunks = {} tokens: give a "
        "longer text or a smaller -c",
        n_tokens, n_ctx, 2 * size_t(n_ctx)));
  ChunkPlan p;
  p.n_ctx = n_ctx;
  p.n_chunk = int(n_tokens / size_t(n_ctx));
  p.first = n_ctx / 2;
  p.n_scored = n_ctx - 1 - p.first;
  return p;
}

MeanError mean_and_error(double sum, double sum2, size_t n) {
  MeanError m;
  if (n == 0) return m;
  m.mean = sum / double(n);
  const double var = sum2 / double(n) - m.mean * m.mean;
  m.error = (n >= 2 && var > 0) ? std::sqrt(var / double(n - 1)) : 0.0;
  return m;
}

double percentile(std::span<const double> sorted, double fraction) {
  if (sorted.empty()) throw std::invalid_argument("percentile of no values");
  if (fraction <= 0) return sorted.front();
  if (fraction >= 1) return sorted.back();
  const double rank = fraction * double(sorted.size() - 1);
  const size_t lo = size_t(rank);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double w = rank - double(lo);
  return (1 - w) * sorted[lo] + w * sorted[hi];
}

double log_sum_exp(const float* row, int n_vocab) {
  float mx = row[0];
  for (int i = 1; i < n_vocab; ++i) mx = std::max(mx, row[i]);
  double sum = 0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(double(row[i]) - double(mx));
  return double(mx) + std::log(sum);
}

namespace {
// P's (or Q's) mass outside the id set `in_set`, in double, in index order.
double mass_outside(const float* row, int n_vocab, double lse, const std::vector<char>& in_set) {
  double m = 0;
  for (int i = 0; i < n_vocab; ++i)
    if (!in_set[size_t(i)]) m += std::exp(double(row[i]) - lse);
  return m;
}
}  // namespace

RefPosition make_ref(const float* row, int n_vocab, int top_k, int32_t next_id) {
  if (top_k < 1 || top_k > n_vocab) throw std::invalid_argument(fmt::format("top-k {} not in [1, {}]", top_k, n_vocab));
  if (next_id < 0 || next_id >= n_vocab)
    throw std::invalid_argument(fmt::format("token {} outside the vocabulary", next_id));
  RefPosition r;
  r.lse = log_sum_exp(row, n_vocab);
  std::vector<int32_t> order(static_cast<size_t>(n_vocab));
  for (int i = 0; i < n_vocab; ++i) order[size_t(i)] = i;
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                    [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  std::vector<char> in_set(size_t(n_vocab), 0);
  r.ids.assign(order.begin(), order.begin() + top_k);
  r.lp.resize(size_t(top_k));
  for (int k = 0; k < top_k; ++k) {
    r.lp[size_t(k)] = log_prob(row[r.ids[size_t(k)]], r.lse);
    in_set[size_t(r.ids[size_t(k)])] = 1;
  }
  r.tail = mass_outside(row, n_vocab, r.lse, in_set);
  r.next_lp = log_prob(row[next_id], r.lse);
  return r;
}

PositionCompare compare_position(const RefPosition& ref, const float* row, int n_vocab, int32_t next_id) {
  if (next_id < 0 || next_id >= n_vocab)
    throw std::invalid_argument(fmt::format("token {} outside the vocabulary", next_id));
  PositionCompare c;
  const double lse = log_sum_exp(row, n_vocab);
  std::vector<char> in_set(size_t(n_vocab), 0);
  double head = 0;
  for (size_t k = 0; k < ref.ids.size(); ++k) {
    const int32_t id = ref.ids[k];
    in_set[size_t(id)] = 1;
    const double lp = double(ref.lp[k]);
    const double lq = double(log_prob(row[id], lse));
    head += std::exp(lp) * (lp - lq);
  }
  // The tail bin: P_T log(P_T / Q_T) (lower bound), and the greedy maximum (upper bound).
  double tail_lo = 0, tail_hi = 0;
  if (ref.tail > 0) {
    const double q_tail = std::max(mass_outside(row, n_vocab, lse, in_set), std::numeric_limits<double>::min());
    tail_lo = ref.tail * (std::log(ref.tail) - std::log(q_tail));
    std::vector<double> lq_tail;
    lq_tail.reserve(size_t(n_vocab) - ref.ids.size());
    for (int i = 0; i < n_vocab; ++i)
      if (!in_set[size_t(i)]) lq_tail.push_back(double(row[i]) - lse);
    std::sort(lq_tail.begin(), lq_tail.end());
    const double p_cap = std::exp(double(ref.lp.back()));  // no tail id is more probable than the K-th
    double left = ref.tail;
    for (size_t j = 0; j < lq_tail.size() && left > 0; ++j) {
      const double a = std::min(p_cap, left);
      tail_hi += a * (std::log(a) - lq_tail[j]);
      left -= a;
    }
    tail_hi = std::max(tail_hi, tail_lo);
  }
  c.tail = ref.tail;
  c.kld = head + tail_lo;
  c.kld_upper = head + tail_hi;
  const double lq_next = double(log_prob(row[next_id], lse));
  c.nll = -lq_next;
  c.nll_base = -double(ref.next_lp);
  c.dp_text = std::exp(lq_next) - std::exp(double(ref.next_lp));
  const int32_t top = ref.ids.front();
  c.dp_top = std::exp(double(log_prob(row[top], lse))) - std::exp(double(ref.lp.front()));
  int32_t arg = 0;
  for (int i = 1; i < n_vocab; ++i)
    if (row[i] > row[arg]) arg = i;
  c.same_top = arg == top;
  return c;
}

KldSummary summarize(std::span<const PositionCompare> pos) {
  KldSummary s;
  s.n = pos.size();
  if (pos.empty()) return s;
  PplAccumulator q, p;
  double d = 0, d2 = 0, k = 0, k2 = 0, ku = 0, same = 0, t2 = 0, t4 = 0, o2 = 0, o4 = 0;
  std::vector<double> klds;
  klds.reserve(pos.size());
  for (const auto& c : pos) {
    q.add(c.nll);
    p.add(c.nll_base);
    const double diff = c.nll - c.nll_base;
    d += diff;
    d2 += diff * diff;
    k += c.kld;
    k2 += c.kld * c.kld;
    ku += c.kld_upper;
    s.tail_mean += c.tail;
    same += c.same_top ? 1 : 0;
    t2 += c.dp_text * c.dp_text;
    t4 += c.dp_text * c.dp_text * c.dp_text * c.dp_text;
    o2 += c.dp_top * c.dp_top;
    o4 += c.dp_top * c.dp_top * c.dp_top * c.dp_top;
    klds.push_back(c.kld);
  }
  const size_t n = pos.size();
  s.ppl = {q.ppl(), q.ppl_error()};
  s.ppl_base = {p.ppl(), p.ppl_error()};
  const MeanError md = mean_and_error(d, d2, n);
  s.ppl_ratio = {std::exp(md.mean), std::exp(md.mean) * md.error};
  s.kld = mean_and_error(k, k2, n);
  s.kld_upper_mean = ku / double(n);
  s.tail_mean /= double(n);
  std::sort(klds.begin(), klds.end());
  s.kld_p99 = percentile(klds, 0.99);
  s.kld_p999 = percentile(klds, 0.999);
  s.kld_median = percentile(klds, 0.5);
  s.kld_max = klds.back();
  const double f = same / double(n);
  s.same_top = {f, n >= 2 ? std::sqrt(f * (1 - f) / double(n - 1)) : 0.0};
  auto rms = [&](double sum2, double sum4) {
    const MeanError ms = mean_and_error(sum2, sum4, n);
    const double r = std::sqrt(ms.mean);
    return MeanError{r, r > 0 ? 0.5 / r * ms.error : 0.0};
  };
  s.rms_dp_text = rms(t2, t4);
  s.rms_dp_top = rms(o2, o4);
  return s;
}

uint64_t fnv1a(const void* data, size_t n, uint64_t h) {
  const auto* b = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t tokenizer_hash(const tokenizer::Tokenizer& tok) {
  uint64_t h = fnv1a(tok.pre_name().data(), tok.pre_name().size());
  for (int32_t i = 0; i < tok.n_vocab(); ++i) {
    const std::string& b = tok.token_bytes(i);
    const uint32_t len = uint32_t(b.size());
    const int32_t type = int32_t(tok.type(i));
    h = fnv1a(&len, 4, h);
    h = fnv1a(b.data(), b.size(), h);
    h = fnv1a(&type, 4, h);
  }
  return h;
}

// ---- the base file ----
namespace {
constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'K', 'L'};

class Writer {
 public:
  void put(const void* p, size_t n) {
    const auto* b = static_cast<const char*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  template <class T>
  void pod(T v) {
    put(&v, sizeof v);
  }
  void str(const std::string& s) {
    pod<uint32_t>(uint32_t(s.size()));
    put(s.data(), s.size());
  }
  std::vector<char>& bytes() { return buf_; }

 private:
  std::vector<char> buf_;
};

class Reader {
 public:
  Reader(const std::vector<char>& b, const std::string& path) : b_(b), path_(path) {}
  void need(size_t n) const {
    if (n > b_.size() - off_)
      throw QualityError(
          fmt::format("KLD base file '{}' is truncated: it ends at byte {} inside its header", path_, b_.size()));
  }
  void get(void* p, size_t n) {
    need(n);
    std::memcpy(p, b_.data() + off_, n);
    off_ += n;
  }
  template <class T>
  T pod() {
    T v{};
    get(&v, sizeof v);
    return v;
  }
  std::string str() {
    const uint32_t n = pod<uint32_t>();
    need(n);
    std::string s(b_.data() + off_, n);
    off_ += n;
    return s;
  }
  size_t offset() const { return off_; }

 private:
  const std::vector<char>& b_;
  std::string path_;
  size_t off_ = 0;
};

size_t record_bytes(uint32_t top_k) { return 8 + 8 + 4 + size_t(top_k) * 8; }
}  // namespace

void write_kld_base(const std::string& path, const KldBase& base) {
  const size_t n_pos = size_t(base.plan.n_chunk) * size_t(base.plan.n_scored);
  if (base.positions.size() != n_pos || base.tokens.size() != size_t(base.plan.n_chunk) * size_t(base.plan.n_ctx))
    throw QualityError("KLD base: positions or tokens do not match the chunk plan");
  Writer w;
  w.put(kMagic, 8);
  w.pod<uint32_t>(KldBase::kVersion);
  w.pod<uint32_t>(base.n_vocab);
  w.pod<uint32_t>(base.top_k);
  w.pod<uint32_t>(uint32_t(base.plan.n_ctx));
  w.pod<uint32_t>(uint32_t(base.plan.n_chunk));
  w.pod<uint32_t>(uint32_t(base.plan.first));
  w.pod<uint32_t>(uint32_t(base.plan.n_scored));
  w.pod<uint64_t>(base.tokenizer_hash);
  w.str(base.model);
  w.str(base.settings);
  w.put(base.tokens.data(), base.tokens.size() * 4);
  for (const RefPosition& r : base.positions) {
    if (r.ids.size() != base.top_k || r.lp.size() != base.top_k)
      throw QualityError("KLD base: a record has the wrong K");
    w.pod<double>(r.lse);
    w.pod<double>(r.tail);
    w.pod<float>(r.next_lp);
    for (uint32_t k = 0; k < base.top_k; ++k) {
      w.pod<int32_t>(r.ids[k]);
      w.pod<float>(r.lp[k]);
    }
  }
  w.pod<uint64_t>(fnv1a(w.bytes().data(), w.bytes().size()));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(w.bytes().data(), std::streamsize(w.bytes().size()));
    out.flush();
    if (!out) throw QualityError(fmt::format("cannot write KLD base file '{}'", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw QualityError(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, ec.message()));
}

KldBase read_kld_base(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw QualityError(fmt::format("cannot open KLD base file '{}'", path));
  std::vector<char> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (b.size() < 8 || std::memcmp(b.data(), kMagic, 8) != 0)
    throw QualityError(
        fmt::format("'{}' is not a strata KLD base file (no STRATAKL magic): write one with `strata perplexity "
                    "--kl-divergence-base FILE` (without --kl-divergence)",
                    path));
  Reader r(b, path);
  char magic[8];
  r.get(magic, 8);
  const uint32_t version = r.pod<uint32_t>();
  if (version != KldBase::kVersion)
    throw QualityError(
        fmt::format("KLD base file '{}' has format version {}; this strata reads version {}: "
                    "write the base again with this strata",
                    path, version, KldBase::kVersion));
  KldBase base;
  base.n_vocab = r.pod<uint32_t>();
  base.top_k = r.pod<uint32_t>();
  base.plan.n_ctx = int(r.pod<uint32_t>());
  base.plan.n_chunk = int(r.pod<uint32_t>());
  base.plan.first = int(r.pod<uint32_t>());
  base.plan.n_scored = int(r.pod<uint32_t>());
  base.tokenizer_hash = r.pod<uint64_t>();
  base.model = r.str();
  base.settings = r.str();
  const auto& p = base.plan;
  if (base.n_vocab == 0 || base.top_k == 0 || base.top_k > base.n_vocab || p.n_ctx < 4 || p.n_chunk < 1 ||
      p.first != p.n_ctx / 2 || p.n_scored != p.n_ctx - 1 - p.first)
    throw QualityError(fmt::format("KLD base file '{}' is corrupt: inconsistent header (vocab {}, K {}, chunk {})",
                                   path, base.n_vocab, base.top_k, p.n_ctx));
  const size_t n_tok = size_t(p.n_chunk) * size_t(p.n_ctx), n_pos = size_t(p.n_chunk) * size_t(p.n_scored);
  const size_t expect = r.offset() + n_tok * 4 + n_pos * record_bytes(base.top_k) + 8;
  if (b.size() != expect)
    throw QualityError(
        fmt::format("KLD base file '{}' is {}: {} bytes, its header says {} ({} chunks of {} tokens, K {})", path,
                    b.size() < expect ? "truncated" : "longer than its header says", b.size(), expect, p.n_chunk,
                    p.n_ctx, base.top_k));
  uint64_t stored = 0;
  std::memcpy(&stored, b.data() + b.size() - 8, 8);
  if (stored != fnv1a(b.data(), b.size() - 8))
    throw QualityError(fmt::format("KLD base file '{}' is corrupt: its checksum does not match its contents", path));
  base.tokens.resize(n_tok);
  r.get(base.tokens.data(), n_tok * 4);
  base.positions.resize(n_pos);
  for (RefPosition& rp : base.positions) {
    rp.lse = r.pod<double>();
    rp.tail = r.pod<double>();
    rp.next_lp = r.pod<float>();
    rp.ids.resize(base.top_k);
    rp.lp.resize(base.top_k);
    for (uint32_t k = 0; k < base.top_k; ++k) {
      rp.ids[k] = r.pod<int32_t>();
      rp.lp[k] = r.pod<float>();
      if (rp.ids[k] < 0 || uint32_t(rp.ids[k]) >= base.n_vocab)
        throw QualityError(
            fmt::format("KLD base file '{}' is corrupt: token id {} outside its vocabulary", path, rp.ids[k]));
    }
  }
  return base;
}

std::vector<double> kld_per_row(std::span<const float> p_log, std::span<const float> q_log, int n_vocab) {
  if (n_vocab <= 0 || p_log.size() != q_log.size() || p_log.size() % size_t(n_vocab) != 0)
    throw std::invalid_argument("kld_per_row: the two sets of rows differ in size or are not whole rows");
  const size_t n = p_log.size() / size_t(n_vocab);
  std::vector<double> out(n);
  for (size_t r = 0; r < n; ++r) {
    const float* p = p_log.data() + r * size_t(n_vocab);
    const float* q = q_log.data() + r * size_t(n_vocab);
    double k = 0;
    for (int i = 0; i < n_vocab; ++i) k += std::exp(double(p[i])) * (double(p[i]) - double(q[i]));
    out[r] = std::max(0.0, k);
  }
  return out;
}

double mean_kld_rows(std::span<const float> p_log, std::span<const float> q_log, int n_vocab) {
  const std::vector<double> k = kld_per_row(p_log, q_log, n_vocab);
  double total = 0;
  for (double v : k) total += v;
  return k.empty() ? 0.0 : total / double(k.size());
}

namespace {
// Empty arena and counters, so every calibration run starts from the same state.
void cold(engine::Engine& eng) {
  eng.stream().cancel_prefetch();
  eng.stream().wait_idle();
  eng.stream().clear();
  eng.reset_stats();
}

// `n` tokens: the prompt, then the model's own continuation at bonus 0 from an empty arena,
// each next token drawn by `next` from the logits (at most the context).
template <class Next>
std::vector<int32_t> continue_prompt(engine::Engine& eng, int n, Next next) {
  const float keep = eng.options().moce_bonus;
  eng.set_moce_bonus(0);
  cold(eng);
  std::vector<int32_t> ids = eng.tokenizer().encode(kMoceCalibrationPrompt);
  if (ids.empty()) ids.push_back(0);
  const size_t cap = size_t(std::max<int64_t>(2, eng.n_ctx()));
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::Last, logits);
  while (ids.size() < cap && int(ids.size()) < n) {
    const int32_t id = next(logits, ids);
    ids.push_back(id);
    if (ids.size() >= cap || int(ids.size()) >= n) break;
    eng.decode(st, id, logits);
  }
  eng.set_moce_bonus(keep);
  return ids;
}
}  // namespace

std::vector<float> teacher_forced_logprobs(engine::Engine& eng, std::span<const int32_t> tokens) {
  cold(eng);
  const int V = eng.hparams().n_vocab;
  std::vector<float> out(tokens.size() * size_t(V)), logits;
  model::SequenceState st = eng.new_sequence();
  for (size_t i = 0; i < tokens.size(); ++i) {
    eng.decode(st, tokens[i], logits);
    const double lse = log_sum_exp(logits.data(), V);
    for (int j = 0; j < V; ++j) out[i * size_t(V) + size_t(j)] = log_prob(logits[size_t(j)], lse);
  }
  return out;
}

std::vector<int32_t> moce_builtin_sample(engine::Engine& eng, int n) {
  return continue_prompt(eng, n, [](const std::vector<float>& logits, const std::vector<int32_t>&) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  });
}

std::vector<std::vector<int32_t>> moce_sampled_texts(engine::Engine& eng, int n_seq, int n) {
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < n_seq; ++i) {
    engine::SamplerParams sp;
    sp.temp = 1.0f;
    sp.top_k = 0;
    sp.top_p = 1.0f;
    sp.min_p = 0.0f;
    sp.repeat_penalty = 1.0f;
    sp.seed = kMoceSampleSeed + uint64_t(i);
    engine::Sampler sampler(sp);
    out.push_back(continue_prompt(eng, n, [&](const std::vector<float>& logits, const std::vector<int32_t>& ids) {
      return sampler.sample(logits, ids);
    }));
  }
  return out;
}

MeanError block_mean_error(std::span<const std::vector<double>> values, int block) {
  if (block < 1) throw std::invalid_argument(fmt::format("block_mean_error: block of {} tokens", block));
  double sum = 0;
  size_t n = 0;
  std::vector<double> means;
  for (const auto& v : values) {
    for (double x : v) sum += x;
    n += v.size();
    for (size_t i = 0; i + size_t(block) <= v.size(); i += size_t(block)) {
      double s = 0;
      for (int j = 0; j < block; ++j) s += v[i + size_t(j)];
      means.push_back(s / block);
    }
  }
  MeanError m;
  if (n == 0) return m;
  m.mean = sum / double(n);
  if (means.size() >= 2) {
    double s = 0, s2 = 0;
    for (double x : means) s += x;
    const double mb = s / double(means.size());
    for (double x : means) s2 += (x - mb) * (x - mb);
    m.error = std::sqrt(s2 / double(means.size() - 1) / double(means.size()));
  }
  return m;
}

MoceCalibration calibrate_moce(engine::Engine& eng, std::span<const std::vector<int32_t>> texts, double budget) {
  if (!(budget > 0) || !std::isfinite(budget))
    throw std::invalid_argument(fmt::format("--moce-kld-budget must be a finite KLD > 0 in nats, got {}", budget));
  if (texts.empty()) throw std::invalid_argument("the MoCE calibration has no text");
  MoceCalibration cal;
  cal.sequences = texts.size();
  size_t blocks = 0;
  for (const auto& t : texts) {
    if (t.size() < 2)
      throw std::invalid_argument(
          fmt::format("a MoCE calibration sequence has {} tokens: give at least 2", t.size()));
    cal.tokens += t.size();
    blocks += t.size() / size_t(kMoceBlock);
  }
  if (blocks < 2)
    throw std::invalid_argument(fmt::format(
        "the MoCE calibration text has {} whole blocks of {} tokens: give at least 2 (its standard error needs them)",
        blocks, kMoceBlock));
  const int V = eng.hparams().n_vocab;
  eng.set_moce_bonus(0);
  std::vector<std::vector<float>> ref;
  for (const auto& t : texts) ref.push_back(teacher_forced_logprobs(eng, t));
  for (float b : kMoceGrid) {
    eng.set_moce_bonus(b);
    MoceGridPoint g;
    g.bonus = b;
    std::vector<std::vector<double>> kld;
    for (size_t s = 0; s < texts.size(); ++s) {
      const std::vector<float> q = teacher_forced_logprobs(eng, texts[s]);
      kld.push_back(kld_per_row(ref[s], q, V));
      g.misses += eng.decode_stats().stream.misses;
    }
    const MeanError m = block_mean_error(kld, kMoceBlock);
    g.kld = m.mean;
    g.kld_error = m.error;
    g.kld_bound = m.mean + kMoceZ * m.error;
    cal.grid.push_back(g);
    if (!(g.kld_bound <= budget)) break;
    cal.bonus = b;
    cal.kld = g.kld;
    cal.kld_bound = g.kld_bound;
  }
  eng.set_moce_bonus(cal.bonus);
  cold(eng);
  return cal;
}

}  // namespace strata::quality
