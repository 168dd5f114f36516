// Pack sidecar: writing (batched O_DIRECT reads of the GGUF's expert tensors, records
// assembled in memory, streamed out through io::WriteFile) and checking (header, checksum,
// size, source identity, geometry). Layout in pack.h.
#include "stream/pack.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>

#include <fmt/format.h>

#include "gguf/gguf.h"
#include "io/file.h"
#include "io/write_file.h"

namespace strata::stream {

namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'P', 'A', 'C', 'K'};
constexpr uint32_t kVersion = 2;  // 2: the sampled expert-data hash at byte 64
constexpr uint64_t kFixedBytes = 72;
constexpr uint64_t kSampleBytes = 4096;  // bytes hashed at the start of each sampled slice
constexpr uint64_t kEntryBytes = 72;
constexpr uint64_t kAlign = io::kDirectAlign;
constexpr uint64_t kBatchBytes = uint64_t(64) << 20;  // records assembled per write

uint64_t ceil_a(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
uint64_t floor_a(uint64_t x) { return x / kAlign * kAlign; }

uint64_t fnv1a(const uint8_t* p, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

template <typename T>
void put(std::vector<uint8_t>& b, size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof v);
}
template <typename T>
T get(const std::vector<uint8_t>& b, size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}

// A file descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  bool read_exact(uint64_t off, void* dst, size_t n) const {
    auto* out = static_cast<uint8_t*>(dst);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, out + done, n - done, off_t(off + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      done += size_t(r);
    }
    return true;
  }
};

// What identifies the GGUF a pack was made from.
struct SourceId {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t hash = 0;
  uint64_t hashed_bytes = 0;
};

// Size and mtime of `path`, and the FNV-1a hash of its first `hashed_bytes` bytes. Throws
// io::IoError when the file cannot be read.
SourceId source_id(const std::string& path, uint64_t hashed_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw io::IoError("cannot stat " + path + ": " + std::strerror(errno));
  SourceId id;
  id.size = uint64_t(st.st_size);
  id.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + int64_t(st.st_mtim.tv_nsec);
  id.hashed_bytes = std::min<uint64_t>(hashed_bytes, id.size);
  Fd fd(path);
  if (fd.fd < 0) throw io::IoError("cannot open " + path + ": " + std::strerror(errno));
  std::vector<uint8_t> buf(size_t(1) << 20);
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t off = 0; off < id.hashed_bytes;) {
    const size_t n = size_t(std::min<uint64_t>(buf.size(), id.hashed_bytes - off));
    if (!fd.read_exact(off, buf.data(), n)) throw io::IoError("cannot read " + path);
    h = fnv1a(buf.data(), n, h);
    off += n;
  }
  id.hash = h;
  return id;
}

// The experts whose slices are sampled for the data hash: the first and the last of each layer
// (the ones a partial rewrite or a truncated copy most likely reaches; two per layer keeps the
// check at load to a few small reads per layer, not a read of the file).
std::vector<int> sampled_experts(int n_expert) {
  if (n_expert <= 0) return {};
  if (n_expert == 1) return {0};
  return {0, n_expert - 1};
}

// FNV-1a 64 of the first kSampleBytes (or fewer) bytes of every part of the sampled experts of
// every layer, read from `fd` at the offsets `offset_of(layer, expert, part)` gives. nullopt
// when a read fails (a file shorter than its layout says).
template <typename OffsetOf>
std::optional<uint64_t> sample_hash(const Fd& fd, const std::vector<LayerExperts>& layers, OffsetOf offset_of) {
  uint64_t h = 0xcbf29ce484222325ull;
  std::vector<uint8_t> buf(kSampleBytes);
  for (size_t l = 0; l < layers.size(); ++l)
    for (int e : sampled_experts(layers[l].n_expert))
      for (int p = 0; p < 3; ++p) {
        const size_t n = size_t(std::min<uint64_t>(kSampleBytes, layers[l].part[p].expert_bytes));
        if (n == 0) continue;
        if (!fd.read_exact(offset_of(l, e, p), buf.data(), n)) return std::nullopt;
        h = fnv1a(buf.data(), n, h);
      }
  return h;
}

// Where everything goes in a pack of `layers` (GGUF layout).
struct PackGeometry {
  uint64_t header_bytes = 0, total_bytes = 0;
  struct Layer {
    uint32_t n_expert = 0;
    uint64_t first = 0, record = 0;
    uint64_t part_off[3] = {0, 0, 0}, part_bytes[3] = {0, 0, 0};
  };
  std::vector<Layer> layers;
};

PackGeometry geometry_for(const std::vector<LayerExperts>& layers) {
  PackGeometry g;
  g.header_bytes = ceil_a(kFixedBytes + kEntryBytes * layers.size() + 8);
  uint64_t pos = g.header_bytes;
  for (const LayerExperts& L : layers) {
    PackGeometry::Layer pl;
    pl.n_expert = uint32_t(std::max(0, L.n_expert));
    uint64_t in_rec = 0;
    for (int p = 0; p < 3; ++p) {
      pl.part_off[p] = in_rec;
      pl.part_bytes[p] = L.part[p].expert_bytes;
      in_rec += L.part[p].expert_bytes;
    }
    pl.record = pl.n_expert ? ceil_a(in_rec) : 0;
    pl.first = pos;
    pos += uint64_t(pl.n_expert) * pl.record;
    g.layers.push_back(pl);
  }
  g.total_bytes = pos;
  return g;
}

std::vector<uint8_t> build_header(const PackGeometry& g, const SourceId& src, uint64_t data_hash) {
  std::vector<uint8_t> h(size_t(g.header_bytes), 0);
  std::memcpy(h.data(), kMagic, 8);
  put<uint32_t>(h, 8, kVersion);
  put<uint32_t>(h, 12, uint32_t(g.header_bytes));
  put<uint64_t>(h, 16, src.size);
  put<int64_t>(h, 24, src.mtime_ns);
  put<uint64_t>(h, 32, src.hash);
  put<uint64_t>(h, 40, src.hashed_bytes);
  put<uint32_t>(h, 48, uint32_t(g.layers.size()));
  put<uint64_t>(h, 56, g.total_bytes);
  put<uint64_t>(h, 64, data_hash);
  size_t at = kFixedBytes;
  for (const auto& L : g.layers) {
    put<uint32_t>(h, at, L.n_expert);
    put<uint64_t>(h, at + 8, L.first);
    put<uint64_t>(h, at + 16, L.record);
    for (int p = 0; p < 3; ++p) {
      put<uint64_t>(h, at + 24 + 8 * size_t(p), L.part_off[p]);
      put<uint64_t>(h, at + 48 + 8 * size_t(p), L.part_bytes[p]);
    }
    at += kEntryBytes;
  }
  put<uint64_t>(h, at, fnv1a(h.data(), at));
  return h;
}

PackedLayout layout_of(const std::string& path, const PackGeometry& g) {
  PackedLayout out;
  out.path = path;
  for (const auto& L : g.layers) {
    LayerExperts le;
    le.n_expert = int(L.n_expert);
    for (int p = 0; p < 3; ++p) le.part[p] = PartLayout{L.first + L.part_off[p], L.part_bytes[p], L.record};
    out.layers.push_back(le);
  }
  return out;
}

// Reads the aligned range covering bytes [off, off + n) of `f` into buf (grown as needed;
// O_DIRECT or not) and returns a pointer to byte `off` in it.
const uint8_t* read_aligned(const io::File& f, uint64_t off, uint64_t n, io::AlignedBuffer& buf) {
  const uint64_t a = floor_a(off), len = ceil_a(off + n) - a;
  if (buf.size() < len) buf = io::AlignedBuffer(size_t(len));
  uint64_t want = len;
  if (!f.direct()) want = std::min<uint64_t>(len, f.size() - a);  // buffered reads stop at EOF
  f.read_at(a, size_t(want), buf.data());
  return buf.data() + (off - a);
}

// Reads bytes [off, off + n) of `f` into dst.
void read_range(const io::File& f, uint64_t off, uint64_t n, io::AlignedBuffer& buf, uint8_t* dst) {
  std::memcpy(dst, read_aligned(f, off, n, buf), size_t(n));
}

PackCheck fail(PackStatus s, std::string msg) {
  PackCheck c;
  c.status = s;
  c.message = std::move(msg);
  return c;
}

}  // namespace

std::string default_pack_path(const std::string& gguf_path) { return gguf_path + ".strata-pack"; }

std::vector<LayerExperts> expert_layers_from_gguf(const gguf::File& f) {
  int64_t n_layer = -1;
  if (const gguf::Value* arch = f.find("general.architecture"); arch && arch->type == gguf::ValueType::STRING)
    n_layer = f.get_int(arch->as_string() + ".block_count", -1);
  if (n_layer < 0) {
    for (const auto& t : f.tensors())
      if (t.layer() >= 0) n_layer = std::max<int64_t>(n_layer, t.layer() + 1);
  }
  std::vector<LayerExperts> layers(size_t(std::max<int64_t>(0, n_layer)));
  static const char* kParts[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
  for (size_t l = 0; l < layers.size(); ++l) {
    const gguf::TensorInfo* t[3];
    int found = 0;
    for (int p = 0; p < 3; ++p) {
      t[p] = f.find_tensor(fmt::format("blk.{}.{}.weight", l, kParts[p]));
      found += t[p] != nullptr;
    }
    if (found == 0) continue;
    if (found != 3)
      throw std::runtime_error(
          fmt::format("{}: block {} has only {} of the 3 expert tensors (gate, up, down)", f.path(), l, found));
    for (int p = 0; p < 3; ++p) {
      if (t[p]->ne.size() != 3 || t[p]->ne[2] != t[0]->ne[2] || t[p]->ne[2] == 0)
        throw std::runtime_error(
            fmt::format("{}: {} has shape {}; expected [cols, rows, n_expert] with the same "
                        "n_expert as {}",
                        f.path(), t[p]->name, t[p]->shape_str(), t[0]->name));
      layers[l].part[p] = PartLayout{t[p]->offset, t[p]->ne[1] * t[p]->row_bytes};
    }
    layers[l].n_expert = int(t[0]->ne[2]);
  }
  return layers;
}

PackResult write_pack(const std::string& gguf_path, const std::string& out_path_in, const PackOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string out_path = out_path_in.empty() ? default_pack_path(gguf_path) : out_path_in;
  const gguf::File g = gguf::File::open(gguf_path);
  const std::vector<LayerExperts> layers = opts.layers.empty() ? expert_layers_from_gguf(g) : opts.layers;
  uint64_t n_records = 0;
  for (const auto& L : layers) n_records += uint64_t(L.n_expert);
  if (n_records == 0) throw std::runtime_error(gguf_path + ": no routed experts (blk.N.ffn_*_exps.weight) to pack");

  const SourceId src_id = source_id(gguf_path, g.data_offset());
  const PackGeometry geo = geometry_for(layers);
  const std::optional<uint64_t> data_hash =
      sample_hash(Fd(gguf_path), layers, [&](size_t l, int e, int p) { return layers[l].part[p].offset(e); });
  if (!data_hash) throw io::IoError(fmt::format("cannot read the expert data of {}", gguf_path));
  const std::vector<uint8_t> header = build_header(geo, src_id, *data_hash);
  const std::unique_ptr<io::File> src = io::File::open(gguf_path, true);

  std::unique_ptr<io::WriteFile> out = io::WriteFile::create(out_path);
  out->write(header.data(), header.size());
  if (opts.progress) opts.progress(out->size(), geo.total_bytes);

  PackResult res;
  res.path = out_path;
  res.records = n_records;
  io::AlignedBuffer in_buf;
  std::vector<uint8_t> batch;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerExperts& L = layers[l];
    const auto& G = geo.layers[l];
    if (L.n_expert == 0) continue;
    res.record_bytes = std::max(res.record_bytes, G.record);
    const int per_batch = int(std::max<uint64_t>(1, kBatchBytes / G.record));
    for (int e0 = 0; e0 < L.n_expert; e0 += per_batch) {
      const int e1 = std::min(L.n_expert, e0 + per_batch);
      batch.assign(size_t(e1 - e0) * G.record, 0);
      for (int p = 0; p < 3; ++p) {
        const PartLayout& P = L.part[p];
        if (P.expert_bytes == 0) continue;
        // The slices of experts e0..e1-1 are back to back in the part's tensor: one aligned
        // read, then each slice straight into its record.
        const uint64_t off = P.offset(e0), n = uint64_t(e1 - e0) * P.expert_bytes;
        const uint8_t* slices = read_aligned(*src, off, n, in_buf);
        for (int e = e0; e < e1; ++e)
          std::memcpy(batch.data() + size_t(e - e0) * G.record + G.part_off[p],
                      slices + size_t(e - e0) * P.expert_bytes, size_t(P.expert_bytes));
      }
      out->write(batch.data(), batch.size());
      if (opts.progress) opts.progress(out->size(), geo.total_bytes);
    }
  }
  if (out->size() != geo.total_bytes)
    throw std::logic_error(fmt::format("pack: wrote {} bytes, expected {}", out->size(), geo.total_bytes));
  out->sync();

  // Verify the finished file before it gets its name: the header parses and matches, and
  // sample records read back (uncached) equal the GGUF's slices.
  const PackCheck check = check_pack(gguf_path, layers, out->tmp_path());
  if (check.status != PackStatus::Ok)
    throw std::runtime_error(fmt::format("pack verification failed: {}", check.message));
  {
    const std::unique_ptr<io::File> packed = io::File::open(out->tmp_path(), true);
    std::vector<std::pair<size_t, int>> samples;
    for (size_t l = 0; l < layers.size(); ++l)
      if (layers[l].n_expert > 0) {
        samples.emplace_back(l, 0);
        samples.emplace_back(l, layers[l].n_expert - 1);
      }
    uint64_t s = 0x2545f4914f6cdd1dull;
    for (int i = 0; i < opts.verify_samples; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const size_t l = size_t((s >> 33) % layers.size());
      if (layers[l].n_expert > 0) samples.emplace_back(l, int((s >> 13) % uint64_t(layers[l].n_expert)));
    }
    io::AlignedBuffer rec_buf, bounce;
    std::vector<uint8_t> want;
    for (const auto& [l, e] : samples) {
      const auto& G = geo.layers[l];
      const uint64_t off = G.first + uint64_t(e) * G.record;
      if (rec_buf.size() < G.record) rec_buf = io::AlignedBuffer(size_t(G.record));
      packed->read_at(off, size_t(G.record), rec_buf.data());
      for (int p = 0; p < 3; ++p) {
        const PartLayout& P = layers[l].part[p];
        want.resize(size_t(P.expert_bytes));
        read_range(*src, P.offset(e), P.expert_bytes, bounce, want.data());
        if (std::memcmp(rec_buf.data() + G.part_off[p], want.data(), want.size()) != 0)
          throw std::runtime_error(
              fmt::format("pack verification failed: {}: layer {} expert {} part {} differs "
                          "from {} after writing",
                          out->tmp_path(), l, e, p, gguf_path));
      }
      ++res.verified;
    }
  }
  out->commit();
  res.bytes = geo.total_bytes;
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

PackCheck check_pack(const std::string& gguf_path, const std::vector<LayerExperts>& layers,
                     const std::string& pack_path_in) {
  const std::string path = pack_path_in.empty() ? default_pack_path(gguf_path) : pack_path_in;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return fail(PackStatus::Missing, "");
    return fail(PackStatus::Unreadable, fmt::format("{}: cannot stat: {}", path, std::strerror(errno)));
  }
  Fd fd(path);
  if (fd.fd < 0) return fail(PackStatus::Unreadable, fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  const uint64_t size = uint64_t(st.st_size);
  if (size < kFixedBytes) return fail(PackStatus::Truncated, fmt::format("{}: truncated ({} bytes)", path, size));
  std::vector<uint8_t> h(kFixedBytes);
  if (!fd.read_exact(0, h.data(), h.size())) return fail(PackStatus::Unreadable, fmt::format("{}: cannot read", path));
  if (std::memcmp(h.data(), kMagic, 8) != 0)
    return fail(PackStatus::BadHeader, fmt::format("{}: not a strata pack", path));
  if (get<uint32_t>(h, 8) != kVersion)
    return fail(PackStatus::BadHeader,
                fmt::format("{}: pack version {} (this build reads {})", path, get<uint32_t>(h, 8), kVersion));
  const uint64_t header_bytes = get<uint32_t>(h, 12);
  const uint32_t n_layers = get<uint32_t>(h, 48);
  if (n_layers > (1u << 20) || header_bytes % kAlign != 0 || header_bytes < kFixedBytes + kEntryBytes * n_layers + 8)
    return fail(PackStatus::BadHeader, fmt::format("{}: corrupt header", path));
  if (size < header_bytes)
    return fail(PackStatus::Truncated,
                fmt::format("{}: truncated ({} bytes, header alone is {})", path, size, header_bytes));
  h.resize(size_t(header_bytes));
  if (!fd.read_exact(0, h.data(), h.size())) return fail(PackStatus::Unreadable, fmt::format("{}: cannot read", path));
  const size_t sum_at = size_t(kFixedBytes + kEntryBytes * n_layers);
  if (get<uint64_t>(h, sum_at) != fnv1a(h.data(), sum_at))
    return fail(PackStatus::BadHeader, fmt::format("{}: header checksum mismatch (corrupt)", path));
  const uint64_t total = get<uint64_t>(h, 56);
  if (size != total)
    return fail(PackStatus::Truncated, fmt::format("{}: {} bytes but the header says {}: {}", path, size, total,
                                                   size < total ? "truncated" : "trailing garbage"));

  SourceId now;
  try {
    now = source_id(gguf_path, get<uint64_t>(h, 40));
  } catch (const std::exception& e) {
    return fail(PackStatus::Unreadable, e.what());
  }
  if (now.size != get<uint64_t>(h, 16) || now.mtime_ns != get<int64_t>(h, 24) || now.hash != get<uint64_t>(h, 32) ||
      now.hashed_bytes != get<uint64_t>(h, 40))
    return fail(PackStatus::Stale, fmt::format("{}: stale: {} changed since the pack was written ({})", path, gguf_path,
                                               now.size != get<uint64_t>(h, 16)   ? "size differs"
                                               : now.hash != get<uint64_t>(h, 32) ? "header differs"
                                                                                  : "modification time differs"));
  if (n_layers != layers.size())
    return fail(PackStatus::Mismatch, fmt::format("{}: {} layers, the model has {}", path, n_layers, layers.size()));

  PackGeometry g;
  g.header_bytes = header_bytes;
  g.total_bytes = total;
  for (uint32_t l = 0; l < n_layers; ++l) {
    const size_t at = size_t(kFixedBytes + kEntryBytes * l);
    PackGeometry::Layer L;
    L.n_expert = get<uint32_t>(h, at);
    L.first = get<uint64_t>(h, at + 8);
    L.record = get<uint64_t>(h, at + 16);
    for (int p = 0; p < 3; ++p) {
      L.part_off[p] = get<uint64_t>(h, at + 24 + 8 * size_t(p));
      L.part_bytes[p] = get<uint64_t>(h, at + 48 + 8 * size_t(p));
    }
    const LayerExperts& want = layers[l];
    bool same = int64_t(L.n_expert) == int64_t(want.n_expert);
    for (int p = 0; p < 3 && same; ++p) same = L.part_bytes[p] == want.part[p].expert_bytes;
    if (!same)
      return fail(PackStatus::Mismatch,
                  fmt::format("{}: layer {} holds {} experts of {}+{}+{} bytes, the model has {} of {}+{}+{}", path, l,
                              L.n_expert, L.part_bytes[0], L.part_bytes[1], L.part_bytes[2], want.n_expert,
                              want.part[0].expert_bytes, want.part[1].expert_bytes, want.part[2].expert_bytes));
    bool sane = L.first >= header_bytes && L.first % kAlign == 0 && L.record % kAlign == 0;
    for (int p = 0; p < 3 && sane; ++p) sane = L.part_off[p] + L.part_bytes[p] <= L.record;
    if (sane && L.n_expert > 0) sane = L.record > 0 && L.first <= total && (total - L.first) / L.record >= L.n_expert;
    if (!sane) return fail(PackStatus::BadHeader, fmt::format("{}: corrupt layer {} entry", path, l));
    g.layers.push_back(L);
  }
  // Expert data, sampled (the first bytes of each part of the first and last expert of every
  // layer), in both files: catches a GGUF rewritten in place with its size, tensor table and mtime
  // kept (cp -p, rsync -a, touch -r), and damaged or zeroed pack records, without reading either
  // file whole.
  const uint64_t want_hash = get<uint64_t>(h, 64);
  const std::optional<uint64_t> gguf_hash =
      sample_hash(Fd(gguf_path), layers, [&](size_t l, int e, int p) { return layers[l].part[p].offset(e); });
  if (!gguf_hash || *gguf_hash != want_hash)
    return fail(PackStatus::Stale,
                fmt::format("{}: stale: the expert data of {} differs from when the pack was written (sampled)", path,
                            gguf_path));
  const std::optional<uint64_t> pack_hash = sample_hash(fd, layers, [&](size_t l, int e, int p) {
    return g.layers[l].first + uint64_t(e) * g.layers[l].record + g.layers[l].part_off[p];
  });
  if (!pack_hash || *pack_hash != want_hash)
    return fail(PackStatus::Corrupt,
                fmt::format("{}: corrupt: its expert records differ from {} (sampled)", path, gguf_path));
  PackCheck ok;
  ok.status = PackStatus::Ok;
  ok.layout = layout_of(path, g);
  return ok;
}

std::optional<PackedLayout> open_pack(const std::string& gguf_path, const std::vector<LayerExperts>& layers,
                                      const std::string& pack_path) {
  PackCheck c = check_pack(gguf_path, layers, pack_path);
  if (c.status == PackStatus::Ok) return std::move(c.layout);
  if (c.status != PackStatus::Missing)
    std::fprintf(stderr, "strata: warning: %s; reading experts from the GGUF (re-run: strata pack -m %s)\n",
                 c.message.c_str(), gguf_path.c_str());
  return std::nullopt;
}

}  // namespace strata::stream
