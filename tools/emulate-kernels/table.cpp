// The kernels that take many tensors through a table (table.cuh: adamw.cu, cast.cu,
// reduce.cu) run on the host (shim.h; tools/emulate-kernels.sh) over tables laid out as
// kernels/gpu_table.rs lays them (the casts, the micro-batches' sums, AdamW; an item's blocks: its length over 256 x 8, at least one, at
// most the cap): every element of every item is written once, by its own item's arithmetic
// (the casts and AdamW bit for bit against the same IEEE operations here, which
// kernels/gpu_tests_step.rs holds against the CPU's tensor ops on a GPU), nothing past an
// item's end is touched, and the sums of squares of each item's blocks add up to its own.
#include "common_host.h"
#include "adamw_host.h"
#include "cast_host.h"
#include "reduce_host.h"
#include <cstdio>
#include <random>

constexpr int THREADS = 256, PER_THREAD = 8;

struct Table {
  std::vector<Item> items;
  unsigned long long blocks = 0;
  size_t cap;
  explicit Table(size_t cap) : cap(cap) {}
  void push(std::initializer_list<const void*> p, size_t n, float k = 0.f, bool flag = false) {
    if (n == 0) return;
    Item it{};
    int i = 0;
    for (auto q : p) it.p[i++] = (unsigned long long)(uintptr_t)q;
    it.n = n; it.first = blocks; it.k = k; it.flag = flag;
    items.push_back(it);
    blocks += std::clamp<size_t>((n + THREADS * PER_THREAD - 1) / (THREADS * PER_THREAD), 1, cap);
  }
};

// Item lengths: one element, one block and one over, several blocks, empty, long.
const std::vector<size_t> SIZES = {1, 2049, 5000, 0, 20000};
const float GUARD = 12345.f;

std::vector<std::vector<float>> values(unsigned seed, float scale, size_t extra = 1) {
  std::mt19937 rng(seed); std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<std::vector<float>> out;
  for (size_t n : SIZES) {
    std::vector<float> v(n + extra, GUARD);
    for (size_t i = 0; i < n; i++) v[i] = u(rng);
    out.push_back(v);
  }
  return out;
}

int check_cast() {
  int bad = 0;
  auto xs = values(1, 3.f);
  std::vector<std::vector<bf16>> src(SIZES.size());
  std::vector<std::vector<float>> dst(SIZES.size());
  Table t(SIZE_MAX);
  for (size_t i = 0; i < SIZES.size(); i++) {
    for (size_t j = 0; j < SIZES[i]; j++) src[i].push_back(__float2bfloat16_rn(xs[i][j]));
    src[i].push_back(__float2bfloat16_rn(0.f));
    dst[i].assign(SIZES[i] + 1, GUARD);
    t.push({src[i].data(), dst[i].data()}, SIZES[i]);
  }
  const float k = 0.3f;
  grid(t.blocks, 1, THREADS, [&] { cast_bf16_f32(t.items.data(), t.items.size(), k, 1); });
  for (size_t i = 0; i < SIZES.size(); i++) {
    for (size_t j = 0; j < SIZES[i]; j++)
      bad += dst[i][j] != __bfloat162float(src[i][j]) * k + 0.f;
    bad += dst[i][SIZES[i]] != GUARD;
  }
  // Masters into bf16 parameters, no factor.
  std::vector<std::vector<bf16>> model(SIZES.size());
  Table m(SIZE_MAX);
  for (size_t i = 0; i < SIZES.size(); i++) {
    model[i].assign(SIZES[i] + 1, __float2bfloat16_rn(GUARD));
    m.push({xs[i].data(), model[i].data()}, SIZES[i]);
  }
  grid(m.blocks, 1, THREADS, [&] { cast_f32_bf16(m.items.data(), m.items.size(), 1.f, 0); });
  for (size_t i = 0; i < SIZES.size(); i++) {
    for (size_t j = 0; j < SIZES[i]; j++) {
      const bf16 w = __float2bfloat16_rn(xs[i][j]);
      bad += memcmp(&model[i][j], &w, 2) != 0;
    }
    bad += __bfloat162float(model[i][SIZES[i]]) != __bfloat162float(__float2bfloat16_rn(GUARD));
  }
  printf("cast: %d wrong\n", bad);
  return bad;
}

int check_add() {
  int bad = 0;
  auto acc = values(7, 5.f), xs = values(8, 3.f);
  std::vector<std::vector<f16>> g(SIZES.size());
  std::vector<std::vector<float>> sum(SIZES.size());
  Table t(SIZE_MAX);
  for (size_t i = 0; i < SIZES.size(); i++) {
    for (size_t j = 0; j < SIZES[i]; j++) g[i].push_back(__float2half_rn(xs[i][j]));
    g[i].push_back(__float2half_rn(0.f));
    sum[i].assign(SIZES[i] + 1, GUARD);
    t.push({acc[i].data(), g[i].data(), sum[i].data()}, SIZES[i]);
  }
  grid(t.blocks, 1, THREADS, [&] { add_f32_f16(t.items.data(), t.items.size()); });
  for (size_t i = 0; i < SIZES.size(); i++) {
    for (size_t j = 0; j < SIZES[i]; j++) bad += sum[i][j] != acc[i][j] + __half2float(g[i][j]);
    bad += sum[i][SIZES[i]] != GUARD;
  }
  printf("add: %d wrong\n", bad);
  return bad;
}

int check_adamw() {
  int bad = 0;
  auto p = values(2, 1.f), g = values(3, .5f), m0 = values(4, .1f), v0 = values(5, .01f);
  for (auto& v : v0) for (auto& x : v) x = x == GUARD ? x : std::abs(x);
  auto p0 = p;
  std::vector<std::vector<float>> m1(SIZES.size()), v1(SIZES.size());
  Table t(SIZE_MAX);
  for (size_t i = 0; i < SIZES.size(); i++) {
    m1[i].assign(SIZES[i] + 1, GUARD); v1[i].assign(SIZES[i] + 1, GUARD);
    const bool decays = i % 2 == 0;
    t.push({p[i].data(), g[i].data(), m0[i].data(), v0[i].data(), m1[i].data(), v1[i].data()},
           SIZES[i], decays ? 0.999f : 1.f, decays);
  }
  Coeffs c{0.9f, 0.1f, 0.999f, 0.001f, 1.2f, 1e-8f, 1e-3f};
  grid(t.blocks, 1, THREADS, [&] { adamw_f32(t.items.data(), t.items.size(), c); });
  for (size_t i = 0; i < SIZES.size(); i++) {
    for (size_t j = 0; j < SIZES[i]; j++) {
      float x = p0[i][j];
      if (i % 2 == 0) x = x * 0.999f + 0.f;
      const float gi = g[i][j];
      const float m = (m0[i][j] * c.b1 + 0.f) + (gi * c.c1 + 0.f);
      const float v = (v0[i][j] * c.b2 + 0.f) + ((gi * gi) * c.c2 + 0.f);
      const float denom = (std::sqrt(v) * c.inv + 0.f) * 1.f + c.eps;
      const float want = x - ((m / denom) * c.step + 0.f);
      bad += p[i][j] != want || m1[i][j] != m || v1[i][j] != v;
    }
    bad += p[i][SIZES[i]] != GUARD || m1[i][SIZES[i]] != GUARD || v1[i][SIZES[i]] != GUARD;
  }
  printf("adamw: %d wrong\n", bad);
  return bad;
}

int check_sum_sq() {
  int bad = 0;
  auto xs = values(6, 2.f);
  Table t(2);  // a cap of 2 blocks: the longer items walk several passes
  std::vector<std::pair<unsigned long long, unsigned long long>> spans;
  for (size_t i = 0; i < SIZES.size(); i++) {
    const unsigned long long first = t.blocks;
    t.push({xs[i].data()}, SIZES[i]);
    spans.push_back({first, t.blocks});
  }
  std::vector<double> partial(t.blocks, -1.0);
  grid(t.blocks, 1, THREADS, [&] { sum_sq_f32(t.items.data(), t.items.size(), partial.data()); });
  for (size_t i = 0; i < SIZES.size(); i++) {
    double got = 0, want = 0;
    for (auto b = spans[i].first; b < spans[i].second; b++) got += partial[b];
    for (size_t j = 0; j < SIZES[i]; j++) want += (double)xs[i][j] * xs[i][j];
    bad += std::abs(got - want) > 1e-12 * std::max(want, 1.0);
  }
  printf("sum_sq: %d wrong\n", bad);
  return bad;
}

int main() {
  const int bad = check_cast() + check_add() + check_adamw() + check_sum_sq();
  printf(bad ? "FAILED\n" : "ok\n");
  return bad != 0;
}
