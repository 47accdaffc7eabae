// Unpacking a gathered bucket into its params on the CPU in one call ([Note: one call per unpack] in
// row_scatter.py): plain byte copies, no rounding, no torch headers.
//
// `src` is `chunks` chunks of `chunk_bytes` each, rank-major: chunk r holds rank r's piece of every
// param in order, piece i `piece_bytes[i]` long. Param i is `chunks` pieces back to back at
// `dst[i]` (its rows). Whole params: one chunk, each piece a whole param.
#include <cstdint>
#include <cstring>

extern "C" void hf_lowzero_unpack_rows(const char* src, int64_t chunks, int64_t chunk_bytes, int64_t count,
                                       const int64_t* piece_bytes, char* const* dst) {
  for (int64_t r = 0; r < chunks; ++r) {
    const char* chunk = src + r * chunk_bytes;
    int64_t offset = 0;
    for (int64_t i = 0; i < count; ++i) {
      std::memcpy(dst[i] + r * piece_bytes[i], chunk + offset, static_cast<size_t>(piece_bytes[i]));
      offset += piece_bytes[i];
    }
  }
}
