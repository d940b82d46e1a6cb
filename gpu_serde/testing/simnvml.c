/*
 * gpu_serde stand-in NVML (libnvidia-ml.so.1) for CPU-only tests, beside the stand-in libcuda.so.1.
 *
 * It presents the GPUs listed in GPU_SERDE_SIM_GPUS ("UUID|NAME|PCI;..."), the same list the stand-in
 * driver reads. Like the real NVML it ignores CUDA_VISIBLE_DEVICES: it enumerates every GPU of the
 * host, in the list's order (which is the driver's order when CUDA_VISIBLE_DEVICES is unset). MIG
 * entries of the list are not enumerated and every GPU reports MIG mode disabled.
 *
 * It implements what Ray's and dask-cuda's GPU detection and distributed's NVML diagnostics call:
 * init/shutdown, counts, handles by index, UUID and PCI bus id, identity, memory, utilisation, CPU
 * affinity (the caller's own), running processes (none), MIG queries and driver versions. Anything
 * else is absent, so pynvml raises NVMLError_FunctionNotFound for it.
 * With GPU_SERDE_SIM_NVML_LOG=path, each call appends its function's name to that file.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    OK = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, NOT_FOUND = 6,
    INSUFFICIENT_SIZE = 7, UNKNOWN = 999,
};

#define MAX_GPUS 64
struct gpu {
    char uuid[41];                   /* "GPU-" + 36 characters, lower case */
    char name[96];
    unsigned domain, bus, device, function;
    unsigned index;
};
typedef struct gpu *nvmlDevice_t;
static struct gpu gpus[MAX_GPUS];
static int n_gpus = 0;
static int spec_ok = 0;
static int refcount = 0;

static void note(const char *fn) {
    const char *path = getenv("GPU_SERDE_SIM_NVML_LOG");
    if (!path || !*path) return;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    char line[128];
    int n = snprintf(line, sizeof line, "%s\n", fn);
    if (n > 0 && write(fd, line, (size_t)n) < 0) { /* best effort */ }
    close(fd);
}
#define NOTE() note(__func__)

static int parse_pci(const char *s, size_t len, unsigned *dom, unsigned *bus, unsigned *dev,
                     unsigned *fn) {
    char buf[48];
    if (len >= sizeof buf) return 0;
    memcpy(buf, s, len); buf[len] = 0;
    return sscanf(buf, "%x:%x:%x.%x", dom, bus, dev, fn) == 4;
}

/* Parse the list once; on a malformed entry every call fails, as the stand-in driver's cuInit does. */
static void parse_spec(void) {
    const char *spec = getenv("GPU_SERDE_SIM_GPUS");
    n_gpus = 0;
    spec_ok = 1;
    if (!spec) return;
    for (const char *p = spec; *p;) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *bar1 = memchr(p, '|', len);
        const char *bar2 = bar1 ? memchr(bar1 + 1, '|', len - (size_t)(bar1 + 1 - p)) : NULL;
        if (len > 0) {
            if (!bar1 || !bar2 || bar1 - p != 40) { spec_ok = 0; return; }
            int mig = strncmp(p, "MIG-", 4) == 0;
            if (!mig && strncmp(p, "GPU-", 4) != 0) { spec_ok = 0; return; }
            for (int i = 4; i < 40; i++) {
                int dash = i == 12 || i == 17 || i == 22 || i == 27;
                if (dash ? p[i] != '-' : !isxdigit((unsigned char)p[i])) { spec_ok = 0; return; }
            }
            if (!mig && n_gpus < MAX_GPUS) {
                struct gpu *g = &gpus[n_gpus];
                for (int i = 0; i < 40; i++) g->uuid[i] = (char)(i < 4 ? p[i] : tolower(p[i]));
                g->uuid[40] = 0;
                size_t nlen = (size_t)(bar2 - bar1 - 1);
                if (nlen >= sizeof g->name) nlen = sizeof g->name - 1;
                memcpy(g->name, bar1 + 1, nlen); g->name[nlen] = 0;
                if (!parse_pci(bar2 + 1, len - (size_t)(bar2 + 1 - p), &g->domain, &g->bus,
                               &g->device, &g->function)) { spec_ok = 0; return; }
                g->index = (unsigned)n_gpus++;
            }
        }
        if (!end) break;
        p = end + 1;
    }
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    NOTE();
    if (refcount == 0) parse_spec();
    if (!spec_ok) return UNKNOWN;
    refcount++;
    return OK;
}
nvmlReturn_t nvmlInit_v2(void) { NOTE(); return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { NOTE(); return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    NOTE();
    if (refcount == 0) return UNINITIALIZED;
    refcount--;
    return OK;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case OK: return "Success";
    case UNINITIALIZED: return "Uninitialized";
    case INVALID_ARGUMENT: return "Invalid Argument";
    case NOT_SUPPORTED: return "Not Supported (gpu_serde simulated NVML)";
    case NOT_FOUND: return "Not Found";
    case INSUFFICIENT_SIZE: return "Insufficient Size";
    case UNKNOWN: return "Unknown Error (GPU_SERDE_SIM_GPUS is malformed)";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t check(nvmlDevice_t d) {
    if (refcount == 0) return UNINITIALIZED;
    if (d < gpus || d >= gpus + n_gpus) return INVALID_ARGUMENT;
    return OK;
}

static nvmlReturn_t copy_str(char *dst, unsigned len, const char *src) {
    if (!dst) return INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return OK;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned len) {
    NOTE();
    return refcount ? copy_str(v, len, "580.95.05") : UNINITIALIZED;
}
nvmlReturn_t nvmlSystemGetNVMLVersion(char *v, unsigned len) {
    NOTE();
    return refcount ? copy_str(v, len, "13.580.95.05") : UNINITIALIZED;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
    NOTE();
    if (!v) return INVALID_ARGUMENT;
    *v = 13000;
    return OK;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { NOTE(); return nvmlSystemGetCudaDriverVersion(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    NOTE();
    if (refcount == 0) return UNINITIALIZED;
    if (!count) return INVALID_ARGUMENT;
    *count = (unsigned)n_gpus;
    return OK;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned *count) { NOTE(); return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *d) {
    NOTE();
    if (refcount == 0) return UNINITIALIZED;
    if (!d || index >= (unsigned)n_gpus) return INVALID_ARGUMENT;
    *d = &gpus[index];
    return OK;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned i, nvmlDevice_t *d) {
    NOTE();
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}

/* The full UUID, any case (NVML takes no prefixes). */
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d) {
    NOTE();
    if (refcount == 0) return UNINITIALIZED;
    if (!uuid || !d) return INVALID_ARGUMENT;
    for (int i = 0; i < n_gpus; i++) {
        if (strcasecmp(uuid, gpus[i].uuid) == 0) { *d = &gpus[i]; return OK; }
    }
    return NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pci, nvmlDevice_t *d) {
    NOTE();
    if (refcount == 0) return UNINITIALIZED;
    unsigned dom, bus, dev, fn;
    if (!pci || !d || !parse_pci(pci, strlen(pci), &dom, &bus, &dev, &fn)) return INVALID_ARGUMENT;
    for (int i = 0; i < n_gpus; i++) {
        struct gpu *g = &gpus[i];
        if (g->domain == dom && g->bus == bus && g->device == dev && g->function == fn) {
            *d = g;
            return OK;
        }
    }
    return NOT_FOUND;
}
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pci, nvmlDevice_t *d) {
    NOTE();
    return nvmlDeviceGetHandleByPciBusId_v2(pci, d);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *index) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!index) return INVALID_ARGUMENT;
    *index = d->index;
    return OK;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned len) {
    NOTE();
    nvmlReturn_t r = check(d);
    return r ? r : copy_str(uuid, len, d->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned len) {
    NOTE();
    nvmlReturn_t r = check(d);
    return r ? r : copy_str(name, len, d->name);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned *minor) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!minor) return INVALID_ARGUMENT;
    *minor = d->index;
    return OK;
}

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!pci) return INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", d->domain, d->bus,
             d->device, d->function);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", d->domain, d->bus, d->device,
             d->function);
    pci->domain = d->domain;
    pci->bus = d->bus;
    pci->device = d->device;
    pci->pciDeviceId = 0x233510DE;   /* an H200's device and vendor id */
    pci->pciSubSystemId = 0x18B010DE;
    return OK;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *p) { NOTE(); return nvmlDeviceGetPciInfo_v3(d, p); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_t *p) { NOTE(); return nvmlDeviceGetPciInfo_v3(d, p); }

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!major || !minor) return INVALID_ARGUMENT;
    *major = 9;
    *minor = 0;
    return OK;
}

#define TOTAL_MEMORY (141ULL << 30)  /* the stand-in driver's cuDeviceTotalMem */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!m) return INVALID_ARGUMENT;
    m->total = TOTAL_MEMORY;
    m->free = TOTAL_MEMORY;
    m->used = 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!m) return INVALID_ARGUMENT;
    m->total = TOTAL_MEMORY;
    m->reserved = 0;
    m->free = TOTAL_MEMORY;
    m->used = 0;
    return OK;
}

typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!u) return INVALID_ARGUMENT;
    u->gpu = 0;
    u->memory = 0;
    return OK;
}

/* No process holds a simulated GPU. */
static nvmlReturn_t no_processes(nvmlDevice_t d, unsigned *count) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return INVALID_ARGUMENT;
    *count = 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *c, void *p) { (void)p; NOTE(); return no_processes(d, c); }
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *c, void *p) { (void)p; NOTE(); return no_processes(d, c); }
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned *c, void *p) { (void)p; NOTE(); return no_processes(d, c); }
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned *c, void *p) { (void)p; NOTE(); return no_processes(d, c); }

/* A simulated GPU is near every CPU this process may run on: report the caller's own affinity. */
static nvmlReturn_t affinity(nvmlDevice_t d, unsigned words, unsigned long *set) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!set || words == 0) return INVALID_ARGUMENT;
    memset(set, 0, words * sizeof *set);
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) != 0) return UNKNOWN;
    const unsigned bits = 8 * sizeof *set;
    for (unsigned cpu = 0; cpu < CPU_SETSIZE && cpu < words * bits; cpu++) {
        if (CPU_ISSET(cpu, &mine)) set[cpu / bits] |= 1UL << (cpu % bits);
    }
    return OK;
}
nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t d, unsigned words, unsigned long *set) {
    NOTE();
    return affinity(d, words, set);
}
nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t d, unsigned words,
                                                 unsigned long *set, unsigned scope) {
    (void)scope;
    NOTE();
    return affinity(d, words, set);
}
nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t d, unsigned words, unsigned long *set,
                                         unsigned scope) {
    (void)scope;
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!set || words == 0) return INVALID_ARGUMENT;
    memset(set, 0, words * sizeof *set);
    set[0] = 1;                      /* NUMA node 0 */
    return OK;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned *current, unsigned *pending) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!current || !pending) return INVALID_ARGUMENT;
    *current = 0;                    /* NVML_DEVICE_MIG_DISABLE */
    *pending = 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned *count) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return INVALID_ARGUMENT;
    *count = 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned i, nvmlDevice_t *mig) {
    (void)i; (void)mig;
    NOTE();
    nvmlReturn_t r = check(d);
    return r ? r : NOT_FOUND;
}
nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned *is_mig) {
    NOTE();
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!is_mig) return INVALID_ARGUMENT;
    *is_mig = 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *d) {
    (void)d;
    NOTE();
    nvmlReturn_t r = check(mig);
    return r ? r : INVALID_ARGUMENT;  /* not a MIG handle */
}

/* Marker so that gpu_serde can tell this library from a real NVML. */
const char *gpu_serde_simulated_nvml(void) { return "gpu_serde simulated NVML 1"; }
