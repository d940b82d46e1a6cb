/*
 * gpu_serde stand-in CUDA driver (libcuda.so.1) for CPU-only tests.
 *
 * It presents the GPUs listed in GPU_SERDE_SIM_GPUS ("UUID|NAME|PCI;UUID|NAME|PCI;...", UUID as
 * "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" or "MIG-...") and applies CUDA_VISIBLE_DEVICES at cuInit
 * the way the real driver does: unset selects every GPU; an empty string selects none; entries are
 * ordinals or GPU-/MIG- UUIDs (full or a unique prefix, any case); the list stops at the first invalid
 * entry. This file holds device enumeration and identity, errors and cuGetProcAddress; contexts,
 * streams and events are in simctx.c, memory pools in simmem.c and their IPC in simipc.c, copies in
 * simcopy.c and virtual memory management in simvmm.c. Every other driver function resolves to a stub
 * that returns CUDA_ERROR_STUB_LIBRARY and names itself (simstub.c): kernels, modules, graphs, and
 * the CUDA runtime's export tables are not simulated.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simdriver.h"

struct gpu { unsigned char uuid[16]; int mig; char name[256]; char pci[32]; };
static struct gpu all_gpus[MAX_GPUS];
static int n_all = -1;               /* -1: not parsed yet, -2: spec invalid */
static int visible[MAX_GPUS];
static int n_visible = 0;
static int initialized = 0;
static CUresult init_result = SUCCESS;

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    c = tolower(c);
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Parse "GPU-" / "MIG-" + 32 hex digits with dashes; return number of hex digits read, -1 on error. */
static int parse_uuid_hex(const char *s, size_t len, unsigned char *out, int allow_prefix) {
    int digits = 0;
    memset(out, 0, 16);
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '-') continue;
        int v = hexval((unsigned char)s[i]);
        if (v < 0 || digits >= 32) return -1;
        if (digits % 2 == 0) out[digits / 2] = (unsigned char)(v << 4);
        else out[digits / 2] |= (unsigned char)v;
        digits++;
    }
    if (!allow_prefix && digits != 32) return -1;
    return digits;
}

/* Say once on stderr why GPU_SERDE_SIM_GPUS is refused (cuInit then fails), its entry shown
 * with anything unprintable as '?'. */
static void bad_spec(int index, const char *entry, size_t len) {
    char shown[61];
    size_t n = 0;
    for (; n < len && n < sizeof shown - 1; n++)
        shown[n] = (entry[n] >= 0x20 && entry[n] < 0x7f) ? entry[n] : '?';
    shown[n] = '\0';
    fprintf(stderr, "gpu_serde simulated driver: GPU_SERDE_SIM_GPUS entry %d (%s%s) is not "
            "GPU-<32 hex digits>|NAME|PCI bus id: cuInit fails with CUDA_ERROR_INVALID_VALUE. "
            "Let gpu_serde.testing.child_env / activate or `gpu-serde simulate` write it\n",
            index, shown, n < len ? "..." : "");
}

static void parse_spec(void) {
    const char *spec = getenv("GPU_SERDE_SIM_GPUS");
    n_all = 0;
    if (!spec) return;
    const char *p = spec;
    while (*p && n_all < MAX_GPUS) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > 0) {
            struct gpu *g = &all_gpus[n_all];
            const char *bar1 = memchr(p, '|', len);
            const char *bar2 = bar1 ? memchr(bar1 + 1, '|', len - (size_t)(bar1 + 1 - p)) : NULL;
            int ok = bar1 && bar2 && bar1 - p >= 5;
            if (ok && strncmp(p, "GPU-", 4) == 0) g->mig = 0;
            else if (ok && strncmp(p, "MIG-", 4) == 0) g->mig = 1;
            else ok = 0;
            if (ok && parse_uuid_hex(p + 4, (size_t)(bar1 - p - 4), g->uuid, 0) != 32) ok = 0;
            if (!ok) { bad_spec(n_all, p, len); n_all = -2; return; }
            size_t nlen = (size_t)(bar2 - bar1 - 1);
            if (nlen >= sizeof g->name) nlen = sizeof g->name - 1;
            memcpy(g->name, bar1 + 1, nlen); g->name[nlen] = 0;
            size_t plen = len - (size_t)(bar2 + 1 - p);
            if (plen >= sizeof g->pci) plen = sizeof g->pci - 1;
            memcpy(g->pci, bar2 + 1, plen); g->pci[plen] = 0;
            n_all++;
        }
        if (!end) break;
        p = end + 1;
    }
}

/* Index of the GPU an entry of CUDA_VISIBLE_DEVICES selects, or -1. */
static int match_entry(const char *s, size_t len) {
    while (len && isspace((unsigned char)*s)) { s++; len--; }
    while (len && isspace((unsigned char)s[len - 1])) len--;
    if (len == 0) return -1;
    int all_digits = 1;
    for (size_t i = 0; i < len; i++) if (!isdigit((unsigned char)s[i])) all_digits = 0;
    if (all_digits) {
        long idx = strtol(s, NULL, 10);
        /* ordinals count the non-MIG GPUs */
        int k = 0;
        for (int i = 0; i < n_all; i++) {
            if (all_gpus[i].mig) continue;
            if (k == idx) return i;
            k++;
        }
        return -1;
    }
    if (len < 5) return -1;
    int mig;
    if (strncasecmp(s, "GPU-", 4) == 0) mig = 0;
    else if (strncasecmp(s, "MIG-", 4) == 0) mig = 1;
    else return -1;
    unsigned char want[16];
    int digits = parse_uuid_hex(s + 4, len - 4, want, 1);
    if (digits <= 0) return -1;
    int found = -1;
    for (int i = 0; i < n_all; i++) {
        if (all_gpus[i].mig != mig) continue;
        int ok = 1;
        for (int d = 0; d < digits && ok; d++) {
            int a = (d % 2 == 0) ? (all_gpus[i].uuid[d / 2] >> 4) : (all_gpus[i].uuid[d / 2] & 15);
            int b = (d % 2 == 0) ? (want[d / 2] >> 4) : (want[d / 2] & 15);
            ok = a == b;
        }
        if (ok) {
            if (found >= 0) return -1; /* ambiguous prefix */
            found = i;
        }
    }
    return found;
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    if (initialized) return init_result;
    initialized = 1;
    if (n_all == -1) parse_spec();
    if (n_all < 0) return init_result = INVALID_VALUE;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    n_visible = 0;
    if (!cvd) {
        for (int i = 0; i < n_all; i++) if (!all_gpus[i].mig) visible[n_visible++] = i;
    } else {
        const char *p = cvd;
        while (1) {
            const char *end = strchr(p, ',');
            size_t len = end ? (size_t)(end - p) : strlen(p);
            int idx = match_entry(p, len);
            if (idx < 0) break;
            for (int j = 0; j < n_visible; j++) if (visible[j] == idx) { idx = -1; break; }
            if (idx < 0 || n_visible >= MAX_GPUS) break;
            visible[n_visible++] = idx;
            if (!end) break;
            p = end + 1;
        }
    }
    return init_result = n_visible ? SUCCESS : NO_DEVICE;
}

static CUresult check(CUdevice dev) {
    if (!initialized) return NOT_INITIALIZED;
    if (init_result != SUCCESS) return init_result;
    if (dev < 0 || dev >= n_visible) return INVALID_DEVICE;
    return SUCCESS;
}

CUresult cuDriverGetVersion(int *v) { if (!v) return INVALID_VALUE; *v = 13000; return SUCCESS; }

CUresult cuDeviceGetCount(int *count) {
    if (!count) return INVALID_VALUE;
    if (!initialized) return NOT_INITIALIZED;
    if (init_result != SUCCESS) return init_result;
    *count = n_visible;
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    if (!dev) return INVALID_VALUE;
    CUresult r = check(ordinal);
    if (r) return r;
    *dev = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    CUresult r = check(dev);
    if (r) return r;
    if (!name || len <= 0) return INVALID_VALUE;
    strncpy(name, all_gpus[visible[dev]].name, (size_t)len - 1);
    name[len - 1] = 0;
    return SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    CUresult r = check(dev);
    if (r) return r;
    if (!uuid) return INVALID_VALUE;
    memcpy(uuid->bytes, all_gpus[visible[dev]].uuid, 16);
    return SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

CUresult cuDeviceGetPCIBusId(char *pci, int len, CUdevice dev) {
    CUresult r = check(dev);
    if (r) return r;
    if (!pci || len <= 0) return INVALID_VALUE;
    strncpy(pci, all_gpus[visible[dev]].pci, (size_t)len - 1);
    pci[len - 1] = 0;
    return SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult r = check(dev);
    if (r) return r;
    if (!bytes) return INVALID_VALUE;
    *bytes = SIM_TOTAL_MEM;
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    CUresult r = check(dev);
    if (r) return r;
    if (!value) return INVALID_VALUE;
    switch (attrib) {
    case 75: *value = 9; break;      /* compute capability major */
    case 76: *value = 0; break;      /* compute capability minor */
    case 16: *value = 132; break;    /* multiprocessor count */
    case 1: *value = 1024; break;    /* max threads per block */
    case 10: *value = 32; break;     /* warp size */
    case 41: *value = 1; break;      /* unified addressing */
    case 19: *value = 1; break;      /* can map host memory */
    case 102: *value = 1; break;     /* virtual memory management */
    case 103: *value = 1; break;     /* POSIX fd handles */
    case 115: *value = 1; break;     /* memory pools */
    case 119: *value = 1; break;     /* pool handle types: POSIX fd */
    case 125: *value = 1; break;     /* IPC events */
    case 130: *value = 0; break;     /* NUMA config: none */
    case 131: case 134: *value = 0; break; /* NUMA id, host NUMA id */
    case 141: case 142: case 144: case 145: *value = 1; break; /* host pools and VMM */
    case 33: case 34: case 50: {     /* PCI bus / device / domain id */
        unsigned dom = 0, bus = 0, devn = 0;
        const char *pci = all_gpus[visible[dev]].pci;
        char *e;
        dom = (unsigned)strtoul(pci, &e, 16);
        if (*e == ':') bus = (unsigned)strtoul(e + 1, &e, 16);
        if (*e == ':') devn = (unsigned)strtoul(e + 1, &e, 16);
        *value = (int)(attrib == 33 ? bus : attrib == 34 ? devn : dom);
        break;
    }
    default: *value = 0; break;
    }
    return SUCCESS;
}

/* Peer access is not simulated: every pair of GPUs says "no" (cuMemcpyPeer still copies). */
CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    CUresult r = check(dev);
    if (!r) r = check(peer);
    if (r) return sim_fail(r, __func__);
    if (!can) return sim_fail(INVALID_VALUE, __func__);
    *can = 0;
    return SUCCESS;
}

CUresult cuDeviceGetP2PAttribute(int *value, int attrib, CUdevice dev, CUdevice peer) {
    (void)attrib;
    CUresult r = check(dev);
    if (!r) r = check(peer);
    if (r) return sim_fail(r, __func__);
    if (!value || dev == peer) return sim_fail(INVALID_DEVICE, __func__);
    *value = 0;
    return SUCCESS;
}

/* The device whose PCI bus id is "[domain]:[bus]:[device].[function]" (hex, any case). */
CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pci) {
    if (!initialized) return sim_fail(NOT_INITIALIZED, __func__);
    if (!dev || !pci) return sim_fail(INVALID_VALUE, __func__);
    unsigned dom, bus, devn, fn = 0, d2, b2, n2, f2;
    int got = sscanf(pci, "%x:%x:%x.%x", &dom, &bus, &devn, &fn);
    if (got < 3) { dom = 0; got = sscanf(pci, "%x:%x.%x", &bus, &devn, &fn) + 1; }
    if (got < 3) return sim_fail(INVALID_VALUE, __func__);
    for (int d = 0; d < n_visible; d++) {
        f2 = 0;
        const char *own = all_gpus[visible[d]].pci;
        if (sscanf(own, "%x:%x:%x.%x", &d2, &b2, &n2, &f2) >= 3 && d2 == dom && b2 == bus && n2 == devn
            && f2 == fn) {
            *dev = d;
            return SUCCESS;
        }
    }
    return sim_fail(INVALID_DEVICE, __func__);
}

CUresult sim_check_device(CUdevice dev) { return check(dev); }
int sim_device_count(void) { return n_visible; }
const unsigned char *sim_device_uuid(CUdevice dev) { return all_gpus[visible[dev]].uuid; }

CUdevice sim_device_by_uuid(const unsigned char *uuid) {
    for (int d = 0; d < n_visible; d++)
        if (memcmp(all_gpus[visible[d]].uuid, uuid, 16) == 0) return d;
    return -1;
}

static const char *err_name(CUresult e);

/* GPU_SERDE_SIM_TRACE=1: every failing call says so on stderr. */
CUresult sim_fail(CUresult code, const char *fn) {
    static int trace = -1;
    if (trace < 0) { const char *t = getenv("GPU_SERDE_SIM_TRACE"); trace = t && strcmp(t, "1") == 0; }
    if (trace && code) {
        const char *name = err_name(code);
        fprintf(stderr, "gpu_serde simulated driver: %s -> %d %s\n", fn, code, name ? name : "");
    }
    return code;
}

static const char *err_name(CUresult e) {
    switch (e) {
    case SUCCESS: return "CUDA_SUCCESS";
    case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY";
    case NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case NOT_PERMITTED: return "CUDA_ERROR_NOT_PERMITTED";
    case NOT_READY: return "CUDA_ERROR_NOT_READY";
    case INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case ALREADY_MAPPED: return "CUDA_ERROR_ALREADY_MAPPED";
    case CONTEXT_ALREADY_CURRENT: return "CUDA_ERROR_CONTEXT_ALREADY_CURRENT";
    case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return NULL;
    }
}

static const char *err_string(CUresult e) {
    switch (e) {
    case SUCCESS: return "no error";
    case INVALID_VALUE: return "invalid argument";
    case NOT_INITIALIZED: return "initialization error";
    case STUB_LIBRARY: return "CUDA driver is a stub library (gpu_serde simulated driver: this call is not simulated)";
    case NO_DEVICE: return "no CUDA-capable device is detected";
    case INVALID_DEVICE: return "invalid device ordinal";
    case INVALID_CONTEXT: return "invalid device context";
    case NOT_FOUND: return "named symbol not found";
    case NOT_PERMITTED: return "operation not permitted";
    case NOT_READY: return "device not ready";
    case INVALID_HANDLE: return "invalid resource handle";
    case ALREADY_MAPPED: return "resource already mapped";
    case CONTEXT_ALREADY_CURRENT: return "context already current";
    case OUT_OF_MEMORY: return "out of memory";
    case NOT_SUPPORTED: return "operation not supported (gpu_serde simulated driver)";
    default: return NULL;
    }
}

CUresult cuGetErrorName(CUresult e, const char **s) {
    if (!s) return INVALID_VALUE;
    /* right after a call that is not simulated, its name (cuda.core's CUDAError shows this text) */
    *s = e == STUB_LIBRARY && sim_stub_label() ? sim_stub_label() : err_name(e);
    return *s ? SUCCESS : INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult e, const char **s) {
    if (!s) return INVALID_VALUE;
    *s = err_string(e);
    return *s ? SUCCESS : INVALID_VALUE;
}

/* Addresses only: each function's prototype is in the file that defines it (simdriver.c's above). */
#define SYM(name, fn) extern char fn[];
#define OWN(name, fn)
#include "simsyms.h"
#undef SYM
#undef OWN
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status);
CUresult cuGetExportTable(const void **table, const CUuuid *id);
struct sym { const char *name; void *fn; };
static const struct sym symbols[] = {
#define SYM(name, fn) {#name, (void *)fn},
#define OWN(name, fn) {#name, (void *)fn},
#include "simsyms.h"
#undef SYM
#undef OWN
    /* cuda-bindings 12.9.0 re-reads its own entry point through itself (CUDA version 12000) */
    {"cuGetProcAddress", (void *)cuGetProcAddress_v2},
    /* the CUDA runtime's start (simstub.c: not simulated) */
    {"cuGetExportTable", (void *)cuGetExportTable},
    {NULL, NULL},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
    (void)version; (void)flags;
    if (!symbol || !pfn) return INVALID_VALUE;
    for (const struct sym *s = symbols; s->name; s++) {
        if (strcmp(s->name, symbol) == 0) {
            *pfn = s->fn;
            if (status) *status = 0;  /* CU_GET_PROC_ADDRESS_SUCCESS */
            return SUCCESS;
        }
    }
    /* any other name: a stub that says it is not simulated (simstub.c) */
    *pfn = sim_stub(symbol);
    if (*pfn) {
        if (status) *status = 0;
        return SUCCESS;
    }
    if (status) *status = 1;          /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return sim_fail(NOT_FOUND, symbol[0] ? symbol : "cuGetProcAddress");
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* Marker so that gpu_serde can tell this library from a real driver. */
const char *gpu_serde_simulated_driver(void) { return "gpu_serde simulated CUDA driver 1"; }
/* whether cuInit has run: from then on the GPUs are fixed (gpu_serde.testing.activate asks) */
int gpu_serde_sim_initialized(void) { return initialized; }
