// tierd native copies: batched block gather (engine KV -> staging) and scatter (staging -> engine KV)
// over every layer of a group at once, plus a host-side loop of async DMAs.
//
// Built by client/native.py (tierd_client.native) through torch.utils.cpp_extension (on first use, cached).
// HIP-portable on purpose: only the runtime API subset hipify maps one to one (cudaMemcpyAsync,
// cudaGetLastError, streams), no inline PTX, no Hopper-only instructions, plain vector types.
// The module holds no torch objects: every pointer and stream arrives as an integer, so it
// compiles against pybind11 and the CUDA runtime alone (fast to build, no ABI coupling).
//
// Geometry (tierd/protocol/layout.py): block b of layer l is, for r in [0, runs),
//   bytes [base_l + b*block_stride_l + r*run_stride_l, +run_bytes)
// and in staging the same block of job j sits at
//   staging + offs[j] + l*layer_pitch, block_bytes = runs*run_bytes contiguous bytes.

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

struct LayerDesc {  // one row of the int64 [layers, 4] table uploaded at registration
  int64_t base;          // device address of the layer span (tensor base + span offset)
  int64_t block_stride;  // bytes between consecutive blocks
  int64_t run_stride;    // bytes between consecutive runs of one block
  int64_t unused;
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("tierd native ") + what + ": " + cudaGetErrorString(err));
  }
}

// One CTA moves one (job, layer) block per iteration of its grid-stride loop; its threads stride
// over the block's vectors, kUnroll loads before the matching stores.
template <typename V, bool SCATTER>
__global__ void __launch_bounds__(kThreads) block_copy(const LayerDesc* __restrict__ layers, int num_layers,
                                                       const int64_t* __restrict__ ids,
                                                       const int64_t* __restrict__ offs, int64_t num_jobs,
                                                       uint8_t* __restrict__ staging, int64_t layer_pitch,
                                                       uint32_t block_vecs, uint32_t run_vecs, int runs) {
  const int64_t pairs = num_jobs * num_layers;
  for (int64_t p = blockIdx.x; p < pairs; p += gridDim.x) {
    const int64_t job = p / num_layers;
    const int layer = static_cast<int>(p - job * num_layers);
    const LayerDesc d = layers[layer];
    uint8_t* eng = reinterpret_cast<uint8_t*>(d.base) + ids[job] * d.block_stride;
    V* stg = reinterpret_cast<V*>(staging + offs[job] + layer * layer_pitch);
    for (uint32_t t0 = threadIdx.x; t0 < block_vecs; t0 += kThreads * kUnroll) {
      V v[kUnroll];
      V* e[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t t = t0 + u * kThreads;
        if (t < block_vecs) {
          if (runs == 1) {
            e[u] = reinterpret_cast<V*>(eng) + t;
          } else {
            const uint32_t r = t / run_vecs;
            e[u] = reinterpret_cast<V*>(eng + r * d.run_stride) + (t - r * run_vecs);
          }
          v[u] = SCATTER ? stg[t] : *e[u];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t t = t0 + u * kThreads;
        if (t < block_vecs) {
          if (SCATTER) {
            *e[u] = v[u];
          } else {
            stg[t] = v[u];
          }
        }
      }
    }
  }
}

template <bool SCATTER>
void launch(int64_t layers, int num_layers, int64_t ids, int64_t offs, int64_t num_jobs, int64_t staging,
            int64_t layer_pitch, int64_t block_bytes, int64_t run_bytes, int runs, int vec, int grid,
            int64_t stream) {
  if (num_jobs <= 0 || num_layers <= 0) return;
  if (vec != 1 && vec != 2 && vec != 4 && vec != 8 && vec != 16) throw std::invalid_argument("vec must be 1, 2, 4, 8 or 16");
  if (block_bytes % vec || run_bytes % vec || runs * run_bytes != block_bytes) {
    throw std::invalid_argument("block_bytes and run_bytes must be multiples of vec, block_bytes = runs * run_bytes");
  }
  if (block_bytes / vec > 0xffffffffLL) throw std::invalid_argument("block too large");
  const auto block_vecs = static_cast<uint32_t>(block_bytes / vec);
  const auto run_vecs = static_cast<uint32_t>(run_bytes / vec);
  auto* L = reinterpret_cast<const LayerDesc*>(layers);
  auto* I = reinterpret_cast<const int64_t*>(ids);
  auto* O = reinterpret_cast<const int64_t*>(offs);
  auto* S = reinterpret_cast<uint8_t*>(staging);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t pairs = num_jobs * num_layers;
  const unsigned g = static_cast<unsigned>(pairs < grid ? pairs : grid);
  switch (vec) {
    case 16: block_copy<uint4, SCATTER><<<g, kThreads, 0, s>>>(L, num_layers, I, O, num_jobs, S, layer_pitch, block_vecs, run_vecs, runs); break;
    case 8: block_copy<uint2, SCATTER><<<g, kThreads, 0, s>>>(L, num_layers, I, O, num_jobs, S, layer_pitch, block_vecs, run_vecs, runs); break;
    case 4: block_copy<uint32_t, SCATTER><<<g, kThreads, 0, s>>>(L, num_layers, I, O, num_jobs, S, layer_pitch, block_vecs, run_vecs, runs); break;
    case 2: block_copy<uint16_t, SCATTER><<<g, kThreads, 0, s>>>(L, num_layers, I, O, num_jobs, S, layer_pitch, block_vecs, run_vecs, runs); break;
    default: block_copy<uint8_t, SCATTER><<<g, kThreads, 0, s>>>(L, num_layers, I, O, num_jobs, S, layer_pitch, block_vecs, run_vecs, runs); break;
  }
  check(cudaGetLastError(), SCATTER ? "scatter launch" : "gather launch");
}

void gather(int64_t layers, int num_layers, int64_t ids, int64_t offs, int64_t num_jobs, int64_t staging,
            int64_t layer_pitch, int64_t block_bytes, int64_t run_bytes, int runs, int vec, int grid, int64_t stream) {
  launch<false>(layers, num_layers, ids, offs, num_jobs, staging, layer_pitch, block_bytes, run_bytes, runs, vec, grid, stream);
}

void scatter(int64_t layers, int num_layers, int64_t ids, int64_t offs, int64_t num_jobs, int64_t staging,
             int64_t layer_pitch, int64_t block_bytes, int64_t run_bytes, int runs, int vec, int grid, int64_t stream) {
  launch<true>(layers, num_layers, ids, offs, num_jobs, staging, layer_pitch, block_bytes, run_bytes, runs, vec, grid, stream);
}

// One cudaMemcpyAsync per (dst, src, size) on ``stream``, without the GIL: the objects of a batch
// are contiguous in the pinned pool, so this is a handful of large DMAs per request.
void memcpy_many(const std::vector<int64_t>& dst, const std::vector<int64_t>& src, const std::vector<int64_t>& sizes,
                 bool device_to_host, int64_t stream) {
  if (dst.size() != src.size() || dst.size() != sizes.size()) throw std::invalid_argument("dst, src, sizes differ in length");
  py::gil_scoped_release nogil;
  const cudaMemcpyKind kind = device_to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (size_t i = 0; i < dst.size(); ++i) {
    check(cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                          static_cast<size_t>(sizes[i]), kind, s),
          "cudaMemcpyAsync");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tierd batched KV block gather/scatter";
  m.attr("THREADS") = kThreads;
  m.def("gather", &gather, "engine blocks of all layers -> staging", py::arg("layers"), py::arg("num_layers"),
        py::arg("ids"), py::arg("offs"), py::arg("num_jobs"), py::arg("staging"), py::arg("layer_pitch"),
        py::arg("block_bytes"), py::arg("run_bytes"), py::arg("runs"), py::arg("vec"), py::arg("grid"),
        py::arg("stream"));
  m.def("scatter", &scatter, "staging -> engine blocks of all layers", py::arg("layers"), py::arg("num_layers"),
        py::arg("ids"), py::arg("offs"), py::arg("num_jobs"), py::arg("staging"), py::arg("layer_pitch"),
        py::arg("block_bytes"), py::arg("run_bytes"), py::arg("runs"), py::arg("vec"), py::arg("grid"),
        py::arg("stream"));
  m.def("memcpy_many", &memcpy_many, "one cudaMemcpyAsync per triple, GIL released", py::arg("dst"), py::arg("src"),
        py::arg("sizes"), py::arg("device_to_host"), py::arg("stream"));
}
