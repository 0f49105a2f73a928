/* mlxcel's BLAS shim: unprefixed CBLAS/LAPACK entry points that jump to the
 * `scipy_`-prefixed ones of the OpenBLAS in the scipy-openblas32 wheel.
 *
 * MLX's CPU backend (libmlx.so) calls plain `cblas_sgemm`, `sgesdd_`, ... which the
 * mlx[cpu] wheel resolves to its bundled reference BLAS. Loaded with RTLD_GLOBAL before
 * mlx, this library's symbols come first, so MLX runs on OpenBLAS instead. Each entry
 * point is a bare tail jump: every argument (Fortran's hidden string lengths included)
 * reaches OpenBLAS untouched, so no signature has to be restated here.
 *
 * The list is what libmlx.so imports (tests/test_blas.py checks it against the
 * installed mlx); a symbol missing here still resolves, to the reference BLAS.
 */

#if defined(__x86_64__)
#define MLXCEL_FORWARD(name)                                  \
    __asm__(".text\n"                                         \
            ".globl " #name "\n"                              \
            ".type " #name ", @function\n"                    \
            #name ":\n"                                       \
            "\tjmp scipy_" #name "@PLT\n"                     \
            ".size " #name ", .-" #name "\n");
#elif defined(__aarch64__)
#define MLXCEL_FORWARD(name)                                  \
    __asm__(".text\n"                                         \
            ".globl " #name "\n"                              \
            ".type " #name ", %function\n"                    \
            #name ":\n"                                       \
            "\tb scipy_" #name "\n"                           \
            ".size " #name ", .-" #name "\n");
#else
#error "mlxcel's BLAS shim supports x86_64 and aarch64 only"
#endif

/* CBLAS */
MLXCEL_FORWARD(cblas_sgemm)
MLXCEL_FORWARD(cblas_dgemm)
MLXCEL_FORWARD(cblas_cgemm)
MLXCEL_FORWARD(cblas_zgemm)
MLXCEL_FORWARD(cblas_sgemv)
MLXCEL_FORWARD(cblas_dgemv)

/* LAPACK (Fortran ABI) */
MLXCEL_FORWARD(sgeev_)
MLXCEL_FORWARD(dgeev_)
MLXCEL_FORWARD(cgeev_)
MLXCEL_FORWARD(sgeqrf_)
MLXCEL_FORWARD(dgeqrf_)
MLXCEL_FORWARD(sgesdd_)
MLXCEL_FORWARD(dgesdd_)
MLXCEL_FORWARD(cgesdd_)
MLXCEL_FORWARD(sgesvd_)
MLXCEL_FORWARD(dgesvd_)
MLXCEL_FORWARD(sgetrf_)
MLXCEL_FORWARD(dgetrf_)
MLXCEL_FORWARD(sgetri_)
MLXCEL_FORWARD(dgetri_)
MLXCEL_FORWARD(sorgqr_)
MLXCEL_FORWARD(dorgqr_)
MLXCEL_FORWARD(spotrf_)
MLXCEL_FORWARD(dpotrf_)
MLXCEL_FORWARD(ssyevd_)
MLXCEL_FORWARD(dsyevd_)
MLXCEL_FORWARD(cheevd_)
MLXCEL_FORWARD(zheevd_)
MLXCEL_FORWARD(strtri_)
MLXCEL_FORWARD(dtrtri_)
