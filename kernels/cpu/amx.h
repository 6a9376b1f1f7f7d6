// Intel AMX (Advanced Matrix Extensions) for the native CPU kernels: whether the tiles may be used in this
// process, and the tile configuration. qgemm.cc multiplies bf16 on them (TDPBF16PS).
//
// Using AMX takes three things, each checked here:
//   - the compiler targets it (-march=native on a CPU with amx_tile / amx_bf16: __AMX_TILE__, __AMX_BF16__);
//   - the kernel grants the process the tile data state: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
//     (Linux 5.16+; without it the first tile instruction kills the process with SIGILL);
//   - each thread loads a tile configuration before its first tile instruction (LDTILECFG).
// Known trap: GCC 12.2's _tile_loadconfig declares too small a memory operand, so the stores that fill the
// configuration can be dropped as dead (llama.cpp's AMX path segfaults when built natively on such a
// host). The configuration is loaded here by inline asm that names the whole 64-byte struct as its input.
#ifndef XLASERVE_KERNELS_CPU_AMX_H_
#define XLASERVE_KERNELS_CPU_AMX_H_

#include <atomic>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define XLASERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace xlaserve {

// Why AMX is off (0: on). XlaserveCpuAmxStatus reports it to kernels/cpu/build.py, which logs it.
enum AmxStatus : int {
  kAmxOn = 0,
  kAmxNotCompiled = 1,  // the compiler did not target AMX: the CPU lacks it (or a non-Linux host)
  kAmxRefused = 2,      // the kernel refused the tile data permission (a kernel before 5.16, or seccomp)
  kAmxDisabled = 3,     // turned off by XlaserveCpuSetAmx(0) (tests compare the AVX-512 path with it)
};

inline std::atomic<int>& amx_requested() {  // 1: use AMX where it is available (the default), 0: never
  static std::atomic<int> requested{1};
  return requested;
}

// Asks the kernel for the tile data permission once per process (it is per process, not per thread).
inline AmxStatus amx_status() {
#if defined(XLASERVE_AMX)
  static const AmxStatus granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? kAmxOn : kAmxRefused;
  }();
  if (granted != kAmxOn) return granted;
  return amx_requested().load(std::memory_order_relaxed) ? kAmxOn : kAmxDisabled;
#else
  return kAmxNotCompiled;
#endif
}

inline bool amx_on() { return amx_status() == kAmxOn; }

#if defined(XLASERVE_AMX)
// The 64-byte LDTILECFG operand (palette 1: 8 tiles of up to 16 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Loads `config` into this thread's tile state (see the GCC trap above: the "m" operand is the whole struct).
inline void load_tile_config(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }
// Returns the tiles to their initial state (a thread that holds none saves less at a context switch).
inline void release_tiles() { asm volatile("tilerelease" ::: "memory"); }
#endif

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_AMX_H_
