/*
 * Shared declarations of gpu_serde's stand-in CUDA driver (simdriver.c, simctx.c, simmem.c, simipc.c,
 * simcopy.c, simvmm.c, simstub.c).
 */
#ifndef GPU_SERDE_SIMDRIVER_H
#define GPU_SERDE_SIMDRIVER_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct sim_ctx *CUcontext;
typedef struct sim_stream *CUstream;
typedef struct sim_event *CUevent;
typedef struct sim_pool *CUmemoryPool;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { unsigned char reserved[64]; } CUmemPoolPtrExportData;
typedef struct { int type; int id; } CUmemLocation;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct {
    int allocType, handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
typedef struct {
    int type, requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage;
             unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;

enum {
    SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, STUB_LIBRARY = 34,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101, INVALID_CONTEXT = 201, CONTEXT_ALREADY_CURRENT = 202, ALREADY_MAPPED = 208,
    INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600, NOT_SUPPORTED = 801, NOT_PERMITTED = 800,
};
enum { LOC_DEVICE = 1, LOC_HOST = 2, LOC_HOST_NUMA = 3, LOC_HOST_NUMA_CURRENT = 4 };
enum { HANDLE_POSIX_FD = 1 };
enum { MEMTYPE_HOST = 1, MEMTYPE_DEVICE = 2 };
#define MAX_GPUS 64
#define GRANULARITY ((size_t)2 << 20)
#define SIM_TOTAL_MEM ((size_t)141 << 30) /* each simulated GPU's memory (an H200's) */

/* simdriver.c */
CUresult sim_check_device(CUdevice dev);
int sim_device_count(void);
const unsigned char *sim_device_uuid(CUdevice dev);
CUdevice sim_device_by_uuid(const unsigned char *uuid);  /* -1 when not visible here */
CUresult sim_fail(CUresult code, const char *fn);          /* returns code; traces it */

/* simstub.c: what is not simulated */
void *sim_stub(const char *symbol);      /* a stub returning CUDA_ERROR_STUB_LIBRARY, or NULL */
const char *sim_stub_label(void);        /* this thread's last stub, as cuGetErrorName shows it */

/* simctx.c */
CUcontext sim_current_ctx(void);
int sim_ctx_device(CUcontext ctx);                         /* -1 if not a context */
CUresult sim_stream_check(CUstream s, int *device);        /* device of the stream (or current) */
void sim_stream_queue(CUstream s);                   /* GPU_SERDE_SIM_WORK_MS more work on s (checked) */
void sim_wait_legacy(void);                          /* a synchronous call: after the legacy stream's work */
extern pthread_mutex_t sim_lock;

/* simmem.c: every range of simulated device or pinned memory this process can touch */
enum { RANGE_POOL = 1, RANGE_VMM = 2, RANGE_HOST = 3 };
struct sim_range {
    uintptr_t base;
    size_t size;
    int kind, memtype, device; /* memtype: MEMTYPE_*; device: -1 for host memory */
    struct sim_pool *pool;     /* RANGE_POOL */
    struct sim_phys *phys;     /* RANGE_VMM */
    int imported;
};
struct sim_range *sim_range_find(uintptr_t p, size_t n); /* the range holding [p, p+n), or NULL */
int sim_range_add(struct sim_range r);
void sim_range_remove(uintptr_t base);
struct sim_range *sim_range_at(uintptr_t base);
void sim_punch(int fd, size_t offset, size_t size);
extern size_t sim_device_bytes; /* device memory this process allocated and holds (cuMemGetInfo) */
int sim_memfd(const char *name, size_t size);
#endif
