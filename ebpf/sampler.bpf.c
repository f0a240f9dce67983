// SPDX-License-Identifier: GPL-2.0 OR MIT
/* enginescope's kernel side: cpu-clock samples and sched_switch intervals of target threads,
 * each with the thread's Python stack read in place (code object address + instruction offset
 * per frame). Everything here records raw facts; names and lines are resolved in user space.
 * Events go to a ring buffer without wakeups (BPF_RB_NO_WAKEUP); user space polls on a timer. */
#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/bpf_perf_event.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "sampler.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

/* Only the fields we read; CO-RE relocates them against the running kernel's BTF. */
struct sched_entity {
    __u64 sum_exec_runtime;
} __attribute__((preserve_access_index));

struct task_struct {
    int pid;
    int tgid;
    struct sched_entity se;
} __attribute__((preserve_access_index));

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, ES_MAX_TARGETS);
    __type(key, __u32);
    __type(value, struct es_target);
} targets SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, ES_MAX_THREADS);
    __type(key, __u32);
    __type(value, struct es_thread);
} threads SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    /* Polled every 20 ms: at 1 kHz on 2 CPUs that is ~12 KiB, and 35k GC edges/s add ~56 KiB;
     * 2 MiB absorbs bursts without holding much resident memory (it is mapped twice). */
    __uint(max_entries, 8 << 20);
} events SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, ES_C_COUNT);
    __type(key, __u32);
    __type(value, __u64);
} counters SEC(".maps");

/* One value: the ES_OFF_* bits of the parts switched off (0 = everything on). An array
 * lookup, inlined by the verifier: a load and a test at each program's start. */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, __u32);
} control SEC(".maps");

static __always_inline int is_off(__u32 part)
{
    __u32 zero = 0;
    const __u32 *v = bpf_map_lookup_elem(&control, &zero);
    return v && (*v & part);
}

/* Per-CPU event buffers, one per program that builds events in place: a syscall tracepoint
 * program can be interrupted by the cpu-clock sample or preempted into sched_switch on the
 * same CPU, so sharing one buffer would let one event overwrite another half-built one. */
#define ES_SLOT_SAMPLE 0
#define ES_SLOT_SWITCH 1
#define ES_SLOT_SYSCALL 2
#define ES_SLOT_WAKE 3
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 4);
    __type(key, __u32);
    __type(value, struct es_event);
} scratch SEC(".maps");

/* Per-CPU native-stack records (sample, switch), ~17 KiB each. */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 2);
    __type(key, __u32);
    __type(value, struct es_native);
} native_scratch SEC(".maps");

/* Threads inside a futex wait on the GIL: tid -> start time. */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, ES_MAX_THREADS);
    __type(key, __u32);
    __type(value, __u64);
} gil_waiting SEC(".maps");

static __always_inline void count(__u32 which)
{
    __u64 *c = bpf_map_lookup_elem(&counters, &which);
    if (c)
        *c += 1;
}

/* A frame's fields, and a code object's, are read with one copy each when they lie within
 * ES_CHUNK bytes of each other (every supported version): a copy from user memory costs about
 * the same for 8 bytes as for 128, and a walk made one per field (up to seven per frame) cost
 * most of what a switch-out does in an engine that switches thousands of times a second. A
 * chunk that cannot be read whole (an object at the end of a mapping) is read field by field. */
#define ES_CHUNK 128
/* 3.11+ keeps a thread's frames on its data stack, each caller just below its callee, a few
 * hundred bytes apiece: one copy of the bytes below a frame holds the chunks of its callers
 * too. A walk copies at most ES_WIN bytes at a time, never below the page of the frame it
 * needs (that page is mapped: its chunk is in it), so one copy per page of stack replaces one
 * per frame (an engine's stack of 30-40 frames spans two or three pages). */
#define ES_WIN 4096
#define ES_PAGE 4096ull
/* Code objects a walk met lately, in front of `code_seen` (below): a direct-mapped table in
 * each CPU's buffer, looked up by indexing where `code_seen` costs a hash lookup per frame
 * (most of a walk's time once its frames came in a copy or two). An entry holds what
 * `code_seen` held when it was copied, its read time included, so it ages out as that does. */
#define ES_CODE_CACHE 256
struct es_code_slot {
    __u64 code;
    __u64 t_ns;
    __u32 tgid;
    __u32 code_id;
    __u32 is_code;
    __u32 pad;
};
struct walk_buf {
    __u8 code[ES_CHUNK + 8];
    __u8 win[ES_WIN + ES_CHUNK + 8];
    struct es_code_slot cache[ES_CODE_CACHE];
};

/* One per event buffer slot (a sample can interrupt a program that walks with IRQs on). */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 4);
    __type(key, __u32);
    __type(value, struct walk_buf);
} walk_bufs SEC(".maps");

/* What a walk's window holds: the user bytes [lo, hi) at walk_buf.win; `last` is the frame
 * frame_window was last asked for (0 at the top). */
struct es_win {
    __u64 lo, hi, last;
    __u8 on; /* frames lie on a data stack (3.11+) */
};

/* Where the ES_CHUNK bytes at `frame + flo` lie in the window (an offset into walk_buf.win), -1
 * when they cannot be read whole. From the window when they lie in it; else copied into it,
 * with the bytes below them down to their page's start (at most ES_WIN) when the frame is the
 * top or lies just below the frame before (a data stack), alone otherwise (3.10's heap frames,
 * a generator's frame) or when the wider copy fails. A function of its own, verified once:
 * inline, the window's bounds (which every frame of the loop changes) kept the verifier from
 * ever finding two states alike. */
__noinline int frame_window(struct walk_buf *b, struct es_win *win, __u64 frame, __u32 flo)
{
    if (!b || !win)
        return -1;
    __u64 at = frame + flo;
    __u64 last = win->last;
    win->last = frame;
    if (at < win->lo || at + ES_CHUNK > win->hi) {
        __u64 lo = at, len = ES_CHUNK;
        count(ES_C_FRAME_COPIES);
        if (win->on && (last == 0 || (frame < last && last - frame < ES_WIN))) {
            __u64 hi = at + ES_CHUNK;
            lo = at & ~(ES_PAGE - 1);
            if (hi - lo > ES_WIN)
                lo = hi - ES_WIN;
            len = hi - lo;
        }
        if (len > ES_WIN || len < ES_CHUNK)
            len = ES_CHUNK;
        if (bpf_probe_read_user(b->win, len, (void *)lo)) {
            lo = at;
            len = ES_CHUNK;
            if (bpf_probe_read_user(b->win, ES_CHUNK, (void *)at)) {
                win->lo = 0;
                win->hi = 0;
                return -1;
            }
        }
        win->lo = lo;
        win->hi = lo + len;
    }
    return (int)((at - win->lo) & (ES_WIN - 1));
}

static __always_inline const __u8 *frame_bytes(struct walk_buf *b, struct es_win *win, __u64 frame, __u32 flo)
{
    int off = frame_window(b, win, frame, flo);
    if (off < 0)
        return 0;
    return b->win + (off & (ES_WIN - 1));
}

static __always_inline __u64 ld64(const __u8 *b, __u32 off)
{
    off &= ES_CHUNK - 1;
    return *(const __u64 *)(b + off);
}

static __always_inline __u32 ld32(const __u8 *b, __u32 off)
{
    off &= ES_CHUNK - 1;
    return *(const __u32 *)(b + off);
}

static __always_inline __u8 ld8(const __u8 *b, __u32 off)
{
    off &= ES_CHUNK - 1;
    return b[off];
}

struct walk_ctx {
    const struct es_target *t;
    struct es_event *ev;
    struct walk_buf *buf;
    __u64 frame;
    /* The walk's process and time (the code objects it has read lately, `code_seen`). */
    __u64 now;
    __u32 tgid;
    __u32 n;
    __u8 flags;
    /* Offsets of the chunks within a frame and a code object; 0xffffffff = read by field. */
    __u32 flo, clo;
    /* The stack's identity: every frame's address, executable and instruction, mixed (valid
     * while every frame's chunk was read). */
    __u64 hash;
    __u8 hash_ok;
    /* The top frame's address and instruction (a quick test before the whole identity). */
    __u64 top, top_instr;
    struct es_win win;
};

/* A stack's identity, with its top frame's address and instruction. */
struct es_walk_id {
    __u64 hash;
    __u64 top;
    __u64 top_instr;
};

/* Per thread, the identity of the stack its last sample or switch-out carried (stacks walked
 * whole only). A switch-out whose stack has the same identity sends no frames. */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, ES_MAX_THREADS);
    __type(key, __u32);
    __type(value, struct es_walk_id);
} last_walk SEC(".maps");

/* Code objects a walk has read lately, per process: what a frame sends of its code object (its
 * identity for user space, `es_frame.code_id`) and whether it is one (`code_type_addr`). A
 * walk reads each frame and its code object; an engine's stacks are tens of frames deep and
 * made of the same few hundred code objects, so the code object's read was half of what a
 * switch-out's walk cost, and what it gives does not change while the object lives. An entry
 * is used for ES_CODE_SEEN_NS after its read, then read again: a code object freed and another
 * made at its address within that time is sent with the old one's identity until then (user
 * space names frames by address and identity). */
#define ES_CODE_SEEN_NS 1000000000ull
struct es_code_key {
    __u64 code;
    __u32 tgid;
    __u32 pad;
};
struct es_code_seen {
    __u64 t_ns;
    __u32 code_id;
    __u32 is_code;
};
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 8192);
    __type(key, struct es_code_key);
    __type(value, struct es_code_seen);
} code_seen SEC(".maps");

/* A frame's instruction field from its chunk (f_lasti widened on 3.10). */
static __always_inline __u64 chunk_instr(const struct es_target *t, const __u8 *chunk, __u32 flo)
{
    if (t->frame_kind == 0)
        return ld32(chunk, t->frame_instr - flo);
    return ld64(chunk, t->frame_instr - flo);
}

static __always_inline __u64 mix(__u64 h, __u64 x)
{
    h = (h ^ x) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 29);
}

/* One frame's part of the stack's identity, from its chunk. */
static __always_inline __u64 mix_frame(const struct es_target *t, const __u8 *chunk, __u32 flo, __u64 h,
                                       __u64 frame)
{
    h = mix(h, frame);
    h = mix(h, ld64(chunk, t->frame_code - flo));
    return mix(h, chunk_instr(t, chunk, flo));
}

#define ES_NO_CHUNK 0xffffffffu

static __always_inline __u32 min_u32(__u32 a, __u32 b)
{
    return a < b ? a : b;
}

static __always_inline __u32 max_u32(__u32 a, __u32 b)
{
    return a > b ? a : b;
}

/* The frame chunk's start, or ES_NO_CHUNK when the fields read span more than ES_CHUNK. */
static __always_inline __u32 frame_chunk(const struct es_target *t)
{
    __u32 isz = t->frame_kind == 0 ? 4 : 8;
    __u32 lo = min_u32(min_u32(t->frame_previous, t->frame_code), t->frame_instr);
    __u32 hi = max_u32(max_u32(t->frame_previous + 8, t->frame_code + 8), t->frame_instr + isz);
    if (t->frame_owner >= 0) {
        lo = min_u32(lo, (__u32)t->frame_owner);
        hi = max_u32(hi, (__u32)t->frame_owner + 1);
    }
    if ((t->flags & ES_TARGET_USTACK) && t->frame_is_entry >= 0) {
        lo = min_u32(lo, (__u32)t->frame_is_entry);
        hi = max_u32(hi, (__u32)t->frame_is_entry + 1);
    }
    return hi - lo <= ES_CHUNK ? lo : ES_NO_CHUNK;
}

/* The code chunk's start (type, co_firstlineno, co_name), or ES_NO_CHUNK. */
static __always_inline __u32 code_chunk(const struct es_target *t)
{
    __u32 lo = min_u32(t->code_firstlineno, t->code_name);
    __u32 hi = max_u32(t->code_firstlineno + 4, t->code_name + 8);
    if (t->code_type_addr) {
        lo = min_u32(lo, 8);
        hi = max_u32(hi, 16);
    }
    return hi - lo <= ES_CHUNK ? lo : ES_NO_CHUNK;
}

/* What a frame sends of its code object (its identity, `*code_id`), remembered in `code_seen`
 * for ES_CODE_SEEN_NS: 1, 0 when the object is not a code object (skip the frame), -1 when it
 * could not be read. A function of its own, verified once: inline in the walk's loop body it
 * made the verifier take seconds. */
struct es_code_io {
    __u64 now;
    __u32 tgid;
    __u32 clo;
    __u32 code_id; /* out */
    __u32 pad;
};

/* Copy what `code_seen` holds of a code object into the walk buffer's table. */
static __always_inline void keep_code(struct es_code_slot *slot, __u64 code, __u32 tgid,
                                      const struct es_code_seen *seen)
{
    if (!slot)
        return;
    slot->code = code;
    slot->t_ns = seen->t_ns;
    slot->tgid = tgid;
    slot->code_id = seen->code_id;
    slot->is_code = seen->is_code;
}

__noinline int code_info(const struct es_target *t, struct walk_buf *b, __u64 code, struct es_code_io *io)
{
    if (!t || !io)
        return -1;
    __u64 now = io->now;
    __u32 tgid = io->tgid, clo = io->clo;
    struct es_code_slot *slot = 0;
    if (b) {
        slot = &b->cache[((code >> 4) ^ (code >> 12) ^ tgid) & (ES_CODE_CACHE - 1)];
        if (slot->code == code && slot->tgid == tgid && now - slot->t_ns < ES_CODE_SEEN_NS) {
            if (!slot->is_code) {
                count(ES_C_SKIPPED_NONCODE);
                return 0;
            }
            io->code_id = slot->code_id;
            return 1;
        }
    }
    struct es_code_key ck = { .code = code, .tgid = tgid, .pad = 0 };
    struct es_code_seen *seen = bpf_map_lookup_elem(&code_seen, &ck);
    if (seen && now - seen->t_ns < ES_CODE_SEEN_NS) {
        keep_code(slot, code, tgid, seen);
        if (!seen->is_code) {
            count(ES_C_SKIPPED_NONCODE);
            return 0;
        }
        io->code_id = seen->code_id;
        return 1;
    }
    count(ES_C_CODE_READS);
    __s32 firstlineno = 0;
    __u64 name = 0;
    int cc = clo != ES_NO_CHUNK && b && bpf_probe_read_user(b->code, ES_CHUNK, (void *)(code + clo)) == 0;
    struct es_code_seen fresh = { .t_ns = now, .code_id = 0, .is_code = 1 };
    if (t->code_type_addr) {
        __u64 type = 0;
        if (cc && b)
            type = ld64(b->code, 8 - clo);
        else if (bpf_probe_read_user(&type, sizeof(type), (void *)(code + 8)))
            type = 0;
        if (type != t->code_type_addr) {
            count(ES_C_SKIPPED_NONCODE);
            /* An unreadable object is not remembered (a read can fail for a page not in
             * yet); a readable one of another type is a shim's (3.11's entry frames). */
            if (type) {
                fresh.is_code = 0;
                bpf_map_update_elem(&code_seen, &ck, &fresh, BPF_ANY);
                keep_code(slot, code, tgid, &fresh);
            }
            return 0;
        }
    }
    if (cc && b) {
        firstlineno = (__s32)ld32(b->code, t->code_firstlineno - clo);
        name = ld64(b->code, t->code_name - clo);
    } else if (bpf_probe_read_user(&firstlineno, sizeof(firstlineno), (void *)(code + t->code_firstlineno)) ||
               bpf_probe_read_user(&name, sizeof(name), (void *)(code + t->code_name))) {
        count(ES_C_READ_FRAME_ERR);
        return -1;
    }
    io->code_id = (__u32)firstlineno ^ (__u32)(name >> 4);
    fresh.code_id = io->code_id;
    bpf_map_update_elem(&code_seen, &ck, &fresh, BPF_ANY);
    keep_code(slot, code, tgid, &fresh);
    return 1;
}

static long walk_one(__u64 index, void *data)
{
    struct walk_ctx *w = data;
    const struct es_target *t = w->t;
    struct walk_buf *b = w->buf;
    __u64 frame = w->frame, prev = 0, code = 0;
    if (frame == 0)
        return 1;
    const __u8 *fb = w->flo != ES_NO_CHUNK && b ? frame_bytes(b, &w->win, frame, w->flo) : 0;
    if (fb) {
        prev = ld64(fb, t->frame_previous - w->flo);
        code = ld64(fb, t->frame_code - w->flo);
        w->hash = mix_frame(t, fb, w->flo, w->hash, frame);
        if (index == 0) {
            w->top = frame;
            w->top_instr = chunk_instr(t, fb, w->flo);
        }
    } else {
        w->hash_ok = 0;
        if (bpf_probe_read_user(&prev, sizeof(prev), (void *)(frame + t->frame_previous)) ||
            bpf_probe_read_user(&code, sizeof(code), (void *)(frame + t->frame_code))) {
            w->flags |= ES_EV_PARTIAL;
            count(ES_C_READ_FRAME_ERR);
            return 1;
        }
    }
    w->frame = prev;
    if (t->frame_owner >= 0) {
        __u8 owner = 0;
        if (fb) {
            owner = ld8(fb, (__u32)t->frame_owner - w->flo);
        } else if (bpf_probe_read_user(&owner, 1, (void *)(frame + t->frame_owner))) {
            w->flags |= ES_EV_PARTIAL;
            count(ES_C_READ_FRAME_ERR);
            return 1;
        }
        /* FRAME_OWNED_BY_CSTACK (3.12/3.13) / _INTERPRETER (3.14+): shim frames. One is
         * pushed by each evaluation-loop call, so the frame before it was entered from C. */
        if (owner >= 3) {
            count(ES_C_SKIPPED_SHIM);
            __u32 last = w->n;
            if ((t->flags & ES_TARGET_USTACK) && last > 0 && last <= ES_MAX_FRAMES)
                w->ev->frames[last - 1].instr_offset |= ES_FRAME_ENTRY;
            return 0;
        }
    }
    code &= ~t->code_tag_mask;
    if (code == 0)
        return 0;
    __s32 offset = -1;
    __u32 code_id = 0;
    struct es_code_io io = { .now = w->now, .tgid = w->tgid, .clo = w->clo, .code_id = 0, .pad = 0 };
    int got = code_info(t, b, code, &io);
    code_id = io.code_id;
    if (got == 0)
        return 0;
    if (got < 0) {
        w->flags |= ES_EV_PARTIAL;
        return 1;
    }
    if (t->frame_kind == 0) {
        __s32 lasti = -1;
        if (fb)
            lasti = (__s32)ld32(fb, t->frame_instr - w->flo);
        else if (bpf_probe_read_user(&lasti, sizeof(lasti), (void *)(frame + t->frame_instr)))
            lasti = -1;
        offset = lasti < 0 ? -1 : lasti * 2;
    } else {
        __u64 instr = 0;
        if (fb) {
            instr = ld64(fb, t->frame_instr - w->flo);
            offset = (__s32)(instr - (code + t->code_adaptive));
        } else if (bpf_probe_read_user(&instr, sizeof(instr), (void *)(frame + t->frame_instr)) == 0) {
            offset = (__s32)(instr - (code + t->code_adaptive));
        }
    }
    if ((t->flags & ES_TARGET_USTACK) && t->frame_is_entry >= 0 && offset >= 0) {
        __u8 entry = 0;
        if (fb)
            entry = ld8(fb, (__u32)t->frame_is_entry - w->flo);
        else if (bpf_probe_read_user(&entry, 1, (void *)(frame + t->frame_is_entry)))
            entry = 0;
        if (entry)
            offset |= ES_FRAME_ENTRY;
    }
    __u32 n = w->n;
    if (n >= ES_MAX_FRAMES) {
        w->flags |= ES_EV_TRUNCATED;
        count(ES_C_TRUNCATED);
        return 1;
    }
    w->ev->frames[n].code = code;
    w->ev->frames[n].instr_offset = offset;
    w->ev->frames[n].code_id = code_id;
    w->n = n + 1;
    return 0;
}

/* The thread's top frame (tstate -> frame, or -> cframe -> current_frame); 0 on a read error. */
static __always_inline int top_frame(const struct es_target *t, __u64 tstate, __u64 *f)
{
    *f = 0;
    if (bpf_probe_read_user(f, sizeof(*f), (void *)(tstate + t->tstate_frame)))
        return 0;
    if (t->cframe_current_frame >= 0 && *f) {
        __u64 cf = *f;
        *f = 0;
        if (bpf_probe_read_user(f, sizeof(*f), (void *)(cf + t->cframe_current_frame)))
            return 0;
    }
    return 1;
}

/* Fill ev->frames with the current thread's Python stack; returns the flags. `slot`: the
 * caller's event buffer slot (its chunk buffers). `*hash` is the stack's identity, 0 when it
 * is not known (a frame read by field, an error, a stack cut short). `win`: what the slot's
 * window holds already (same_stack's copies of this stack, this instant), or NULL. */
static __always_inline __u8 walk_stack(const struct es_target *t, __u64 tstate, struct es_event *ev, __u32 slot,
                                       struct es_walk_id *id, const struct es_win *win)
{
    struct walk_ctx w = { .t = t, .ev = ev, .frame = 0, .n = 0, .flags = 0, .hash = 1, .hash_ok = 1,
                          .now = bpf_ktime_get_ns(), .tgid = ev->h.tgid };
    if (win) {
        w.win.lo = win->lo;
        w.win.hi = win->hi;
    }
    w.win.on = t->frame_kind == 1;
    id->hash = 0;
    w.buf = bpf_map_lookup_elem(&walk_bufs, &slot);
    w.flo = frame_chunk(t);
    w.clo = code_chunk(t);
    __u64 f = 0;
    if (!top_frame(t, tstate, &f)) {
        count(ES_C_READ_TSTATE_ERR);
        ev->h.nframes = 0;
        return ES_EV_PARTIAL;
    }
    w.frame = f;
    /* Shim frames are skipped without using an output slot, so allow some extra steps. */
    bpf_loop(ES_MAX_FRAMES + 32, walk_one, &w, 0);
    if (w.frame != 0 && !(w.flags & (ES_EV_PARTIAL | ES_EV_TRUNCATED))) {
        w.flags |= ES_EV_TRUNCATED;
        count(ES_C_TRUNCATED);
    }
    ev->h.nframes = w.n;
    if (w.hash_ok && w.frame == 0 && !(w.flags & (ES_EV_PARTIAL | ES_EV_TRUNCATED))) {
        id->hash = w.hash;
        id->top = w.top;
        id->top_instr = w.top_instr;
    }
    return w.flags;
}

struct hash_ctx {
    const struct es_target *t;
    struct walk_buf *buf;
    __u64 frame;
    __u64 hash;
    __u32 flo;
    __u8 ok;
    struct es_win win;
};

static long hash_one(__u64 index, void *data)
{
    struct hash_ctx *c = data;
    __u64 frame = c->frame;
    if (frame == 0)
        return 1;
    struct walk_buf *b = c->buf;
    const __u8 *fb = b ? frame_bytes(b, &c->win, frame, c->flo) : 0;
    if (!fb) {
        c->ok = 0;
        return 1;
    }
    const struct es_target *t = c->t;
    c->hash = mix_frame(t, fb, c->flo, c->hash, frame);
    c->frame = ld64(fb, t->frame_previous - c->flo);
    return 0;
}

/* Whether the thread's stack has identity `last` (what walk_stack would give it), reading each
 * frame's chunk (through the window) and nothing of the code objects; a different top frame or
 * instruction, the common case, is told from the first chunk. `*win`: what the slot's window
 * holds afterwards, for the walk that follows a difference. */
static __always_inline int same_stack(const struct es_target *t, __u64 tstate, __u32 slot,
                                      const struct es_walk_id *last, struct es_win *win)
{
    struct hash_ctx c = { .t = t, .frame = 0, .hash = 1, .ok = 1 };
    c.win.on = t->frame_kind == 1;
    c.flo = frame_chunk(t);
    c.buf = bpf_map_lookup_elem(&walk_bufs, &slot);
    if (c.flo == ES_NO_CHUNK || !c.buf || !top_frame(t, tstate, &c.frame) || c.frame != last->top)
        return 0;
    /* The top's bytes (with the window below them, which the walk then reads from). */
    const __u8 *top = frame_bytes(c.buf, &c.win, c.frame, c.flo);
    win->lo = c.win.lo;
    win->hi = c.win.hi;
    if (!top || chunk_instr(t, top, c.flo) != last->top_instr)
        return 0;
    bpf_loop(ES_MAX_FRAMES + 32, hash_one, &c, 0);
    win->lo = c.win.lo;
    win->hi = c.win.hi;
    return c.ok && c.frame == 0 && c.hash == last->hash;
}

static __always_inline __u8 gil_gc_flags(const struct es_target *t, __u64 tstate)
{
    __u8 flags = 0;
    if (t->gil_locked_addr) {
        int locked = 0;
        __u64 holder = 0;
        if (bpf_probe_read_user(&locked, sizeof(locked), (void *)t->gil_locked_addr) ||
            bpf_probe_read_user(&holder, sizeof(holder), (void *)t->gil_holder_addr))
            count(ES_C_GIL_READ_ERR);
        else if (locked && holder == tstate)
            flags |= ES_EV_GIL;
    }
    if (t->gc_collecting_addr) {
        int collecting = 0;
        if (bpf_probe_read_user(&collecting, sizeof(collecting), (void *)t->gc_collecting_addr))
            count(ES_C_GC_READ_ERR);
        else if (collecting)
            flags |= ES_EV_GC;
    }
    return flags;
}

static __always_inline void submit(struct es_event *ev)
{
    __u32 n = ev->h.nframes;
    if (n > ES_MAX_FRAMES)
        n = ES_MAX_FRAMES;
    __u64 size = sizeof(struct es_event_header) + (__u64)n * sizeof(struct es_frame);
    if (size > sizeof(struct es_event))
        size = sizeof(struct es_event);
    if (bpf_ringbuf_output(&events, ev, size, BPF_RB_NO_WAKEUP))
        count(ES_C_RINGBUF_FULL);
}


/* Kernel stack and the user stack window of the current thread, as a record sent right before
 * the sample / switch-out that carries the same tid and time. `uregs` are the user registers
 * when the caller has them (a sample taken in user mode), else NULL: they are then read from
 * the task's saved user registers (the kernel entry frame). `window`: bytes of user stack to
 * copy (the thread's ustack_window; 0 = all). */
static __always_inline void record_native(void *ctx, __u32 slot, const struct es_target *t, __u32 tgid,
                                          __u32 tid, __u64 time_ns, const struct pt_regs *uregs,
                                          int blocked, __u32 window)
{
    struct es_native *n = bpf_map_lookup_elem(&native_scratch, &slot);
    if (!n)
        return;
    n->h.kind = ES_EV_NATIVE_STACK;
    n->h.flags = 0;
    n->h.nframes = 0;
    n->h.tgid = tgid;
    n->h.tid = tid;
    n->h.cpu = bpf_get_smp_processor_id();
    n->h.time_ns = time_ns;
    n->h.ip = 0;
    n->sp = 0;
    n->bp = 0;
    n->ustack_len = 0;
    n->nkernel = 0;
    n->pad = 0;
    /* A sample taken in user mode (uregs) has no kernel stack. */
    if ((t->flags & ES_TARGET_KSTACK) && !uregs) {
        long got = bpf_get_stack(ctx, n->kstack, sizeof(n->kstack), 0);
        if (got < 0)
            count(ES_C_KSTACK_ERR);
        else
            n->nkernel = (__u16)((__u64)got / 8);
    }
    if (t->flags & ES_TARGET_USTACK) {
        struct pt_regs r = {};
        if (uregs) {
            r.rip = uregs->rip;
            r.rsp = uregs->rsp;
            r.rbp = uregs->rbp;
        } else {
            struct task_struct *task = bpf_get_current_task_btf();
            struct pt_regs *tr = (struct pt_regs *)bpf_task_pt_regs(task);
            if (!tr || bpf_probe_read_kernel(&r, sizeof(r), tr))
                r.rsp = 0;
        }
        n->h.ip = r.rip;
        n->sp = r.rsp;
        n->bp = r.rbp;
        __u64 sp = r.rsp;
        __u32 len = 0;
        /* A window sized from this thread's earlier unwinds (most need 1-2 KiB of the 16):
         * copying less is most of what a native stack costs here and in user space. A
         * thread blocking in a system call is a few native frames below its evaluation
         * loop: at most 4 KiB (a deeper one gets its innermost frames, and the Python frames
         * above them). */
        __u64 want = window ? window : ES_USTACK_MAX;
        if (blocked && want > 4096)
            want = 4096;
        if (want < 64)
            want = 64;
        if (sp && want < ES_USTACK_MAX) {
            /* Hide want's range from the compiler so that the mask the verifier needs stays. */
            asm volatile("" : "+r"(want));
            want &= ES_USTACK_MAX - 1;
            if (bpf_probe_read_user(n->ustack, want, (void *)sp) == 0) {
                len = want;
            } else {
                /* Crossing the stack's end: up to the end of sp's page (stacks end on a
                 * page boundary), or of the next one. */
                __u64 rest = 4096 - (sp & 4095);
                __u64 two = rest + 4096;
                asm volatile("" : "+r"(two));
                two &= ES_USTACK_MAX - 1;
                if (two < want && bpf_probe_read_user(n->ustack, two, (void *)sp) == 0)
                    len = two;
                else if (rest < want && rest <= 4096 &&
                         bpf_probe_read_user(n->ustack, rest, (void *)sp) == 0)
                    len = rest;
            }
        } else if (sp) {
            /* The stack's top is not known: try a full window, then smaller ones, then up
             * to the end of sp's page. */
            if (bpf_probe_read_user(n->ustack, ES_USTACK_MAX, (void *)sp) == 0)
                len = ES_USTACK_MAX;
            else if (bpf_probe_read_user(n->ustack, 12288, (void *)sp) == 0)
                len = 12288;
            else if (bpf_probe_read_user(n->ustack, 8192, (void *)sp) == 0)
                len = 8192;
            else if (bpf_probe_read_user(n->ustack, 4096, (void *)sp) == 0)
                len = 4096;
            else {
                __u32 rest = 4096 - (__u32)(sp & 4095);
                if (rest > 0 && rest <= 4096 && bpf_probe_read_user(n->ustack, rest, (void *)sp) == 0)
                    len = rest;
            }
        }
        if (!len)
            count(ES_C_USTACK_READ_ERR);
        n->ustack_len = len;
    }
    __u64 size = __builtin_offsetof(struct es_native, ustack) + (__u64)(n->ustack_len & (ES_USTACK_MAX * 2 - 1));
    if (size > sizeof(struct es_native))
        size = sizeof(struct es_native);
    count(ES_C_NATIVE_STACKS);
    if (bpf_ringbuf_output(&events, n, size, BPF_RB_NO_WAKEUP))
        count(ES_C_RINGBUF_FULL);
}

static __always_inline void record_current(void *ctx, __u32 slot, __u8 kind, const struct es_target *t, __u32 tgid,
                                           __u32 tid, __u64 ip, __u8 extra_flags, const struct pt_regs *uregs)
{
    struct es_event *ev = bpf_map_lookup_elem(&scratch, &slot);
    if (!ev)
        return;
    __u64 now = bpf_ktime_get_ns();
    struct es_thread *th = bpf_map_lookup_elem(&threads, &tid);
    if (t->flags & (ES_TARGET_KSTACK | ES_TARGET_USTACK))
        /* Blocked in a system call: a shallow native stack. A preempted thread was stopped
         * anywhere, as a sampled one is. */
        record_native(ctx, slot, t, tgid, tid, now, uregs,
                      kind == ES_EV_SWITCH_OUT && !(extra_flags & ES_EV_PREEMPTED),
                      th && th->tgid == tgid ? th->ustack_window : 0);
    ev->h.kind = kind;
    ev->h.tgid = tgid;
    ev->h.tid = tid;
    ev->h.cpu = bpf_get_smp_processor_id();
    ev->h.time_ns = now;
    ev->h.ip = ip;
    ev->h.nframes = 0;
    __u8 flags = extra_flags;
    if (!th || th->tgid != tgid) {
        count(ES_C_NO_TSTATE);
        flags |= ES_EV_NO_TSTATE;
    } else {
        /* A thread switched out where it was when its stack was last walked (blocked again
         * in the same call, preempted in the same loop) sends no frames: user space gives it
         * that stack. Not with native stacks, which may differ below the same Python frames. */
        struct es_win win = {};
        if (kind == ES_EV_SWITCH_OUT && !(t->flags & (ES_TARGET_KSTACK | ES_TARGET_USTACK))) {
            const struct es_walk_id *last = bpf_map_lookup_elem(&last_walk, &tid);
            if (last && same_stack(t, th->tstate, slot, last, &win)) {
                count(ES_C_SAME_STACK);
                ev->h.flags = flags | ES_EV_SAME_STACK;
                if (bpf_ringbuf_output(&events, &ev->h, sizeof(ev->h), BPF_RB_NO_WAKEUP))
                    count(ES_C_RINGBUF_FULL);
                return;
            }
        }
        struct es_walk_id id = {};
        flags |= walk_stack(t, th->tstate, ev, slot, &id, &win);
        flags |= gil_gc_flags(t, th->tstate);
        if (id.hash)
            bpf_map_update_elem(&last_walk, &tid, &id, BPF_ANY);
        else
            bpf_map_delete_elem(&last_walk, &tid);
    }
    ev->h.flags = flags;
    submit(ev);
}

SEC("perf_event")
int on_sample(struct bpf_perf_event_data *ctx)
{
    if (is_off(ES_OFF_SAMPLE))
        return 0;
    __u64 id = bpf_get_current_pid_tgid();
    __u32 tgid = id >> 32, tid = (__u32)id;
    const struct es_target *t = bpf_map_lookup_elem(&targets, &tgid);
    if (!t)
        return 0;
    count(ES_C_SAMPLES);
    /* uapi pt_regs: 8-byte cs (narrower context loads are rejected by the verifier). */
    __u64 cs = ctx->regs.cs;
    __u64 ip = ctx->regs.rip;
    __u8 flags = 0;
    if ((cs & 3) == 0) {
        flags |= ES_EV_KERNEL | ES_EV_NATIVE;
    } else if (ip < t->text_lo || ip >= t->text_hi) {
        flags |= ES_EV_NATIVE;
    }
    /* The thread's CPU time as the scheduler counts it (advanced at each tick and switch,
     * without what the hypervisor stole): cpu-clock runs on while a vCPU is stolen. */
    struct task_struct *task = bpf_get_current_task_btf();
    __u64 runtime = BPF_CORE_READ(task, se.sum_exec_runtime);
    record_current(ctx, ES_SLOT_SAMPLE, ES_EV_SAMPLE, t, tgid, tid, runtime, flags,
                   (cs & 3) ? (const struct pt_regs *)&ctx->regs : 0);
    return 0;
}

/* A record with no stack: a switch-in, or a switch-out of a still-runnable thread. */
static __always_inline void submit_header(__u8 kind, __u8 flags, __u32 tgid, __u32 tid, __u64 ip)
{
    struct es_event_header h = {
        .kind = kind,
        .flags = flags,
        .nframes = 0,
        .tgid = tgid,
        .tid = tid,
        .cpu = bpf_get_smp_processor_id(),
        .time_ns = bpf_ktime_get_ns(),
        .ip = ip,
    };
    if (bpf_ringbuf_output(&events, &h, sizeof(h), BPF_RB_NO_WAKEUP))
        count(ES_C_RINGBUF_FULL);
}

#define ES_NR_SCHED_YIELD 24 /* x86-64 */
#define ES_NR_FUTEX 202      /* x86-64 */
/* futex(2) operations (linux/futex.h): the command is op without FUTEX_PRIVATE_FLAG (128) and
 * FUTEX_CLOCK_REALTIME (256). */
#define ES_FUTEX_CMD_MASK 127
#define ES_FUTEX_WAIT 0
#define ES_FUTEX_LOCK_PI 6
#define ES_FUTEX_WAIT_BITSET 9
#define ES_FUTEX_WAIT_REQUEUE_PI 11
#define ES_FUTEX_LOCK_PI2 13
#define ES_FUTEX_WAKE 1
#define ES_FUTEX_REQUEUE 3
#define ES_FUTEX_CMP_REQUEUE 4
#define ES_FUTEX_WAKE_OP 5
#define ES_FUTEX_UNLOCK_PI 7
#define ES_FUTEX_WAKE_BITSET 10

/* The system call the current task is in and its first two arguments, from the user
 * registers the kernel saved at entry (x86-64 struct pt_regs: si at 104, di at 112, orig_ax at
 * 120). nr is -1 when the task entered the kernel by an interrupt or exception (preempted, a
 * page fault). Returns 0 when they could not be read. */
struct es_syscall {
    __u64 si, di, nr;
};

static __always_inline int current_syscall(struct es_syscall *sc)
{
    struct task_struct *task = bpf_get_current_task_btf();
    void *tr = (void *)bpf_task_pt_regs(task);
    if (!tr || bpf_probe_read_kernel(sc, sizeof(*sc), (char *)tr + 104))
        return 0;
    return 1;
}

/* Is the current task switching out inside sched_yield(2)? (-1 after an interrupt from user
 * mode: preempted.) */
static __always_inline int in_sched_yield(void)
{
    struct es_syscall sc = {};
    return current_syscall(&sc) && sc.nr == ES_NR_SCHED_YIELD;
}

/* A thread of target t blocks in futex(2) (it is being switched out asleep, in prev's context:
 * its memory is the current address space): when the futex word is in the GIL's condition
 * variables or mutexes, a GIL wait begins (ended at its switch-in). Timed from the sleep, not
 * from the system call's entry: a futex call that returns at once (the word changed) waits for
 * nothing. Tracing the switch instead of sys_enter/sys_exit leaves every other system call of
 * every process on the machine untouched (an engine's busy-wait loops make ~77k/s). */
static __always_inline void gil_wait_begins(const struct es_target *t, __u32 tgid, __u32 tid)
{
    struct es_syscall sc = {};
    if (!current_syscall(&sc) || sc.nr != ES_NR_FUTEX)
        return;
    __u64 uaddr = sc.di, op = sc.si;
    /* Only the operations that block: a FUTEX_WAKE (a thread dropping the GIL signals the
     * condition, unlocks a contended mutex) is not a wait. */
    switch (op & ES_FUTEX_CMD_MASK) {
    case ES_FUTEX_WAIT:
    case ES_FUTEX_LOCK_PI:
    case ES_FUTEX_WAIT_BITSET:
    case ES_FUTEX_WAIT_REQUEUE_PI:
    case ES_FUTEX_LOCK_PI2:
        break;
    default:
        return;
    }
    __u64 off = uaddr - t->gil_addr;
    if (off < t->gil_cond_off || off >= t->gil_size)
        return;
    __u64 now = bpf_ktime_get_ns();
    bpf_map_update_elem(&gil_waiting, &tid, &now, BPF_ANY);
    count(ES_C_GIL_WAITS);

    __u32 slot = ES_SLOT_SYSCALL;
    struct es_event *ev = bpf_map_lookup_elem(&scratch, &slot);
    if (!ev)
        return;
    ev->h.kind = ES_EV_GIL_WAIT_START;
    ev->h.tgid = tgid;
    ev->h.tid = tid;
    ev->h.cpu = (__u32)off;
    ev->h.time_ns = now;
    ev->h.nframes = 0;
    __u8 flags = off >= t->gil_switch_off ? ES_EV_SWITCH_WAIT : 0;
    /* Who holds the GIL now, and what is it running? Same address space: read its stack. */
    int locked = 0;
    __u64 holder = 0;
    if (bpf_probe_read_user(&locked, sizeof(locked), (void *)t->gil_locked_addr) ||
        bpf_probe_read_user(&holder, sizeof(holder), (void *)t->gil_holder_addr)) {
        count(ES_C_GIL_READ_ERR);
        holder = 0;
    }
    if (!locked)
        holder = 0;
    /* Blocked on one of the GIL's mutexes rather than on a condition variable: what blocks the
     * waiter is that mutex's owner (a thread dropping or taking the GIL, often while `locked`
     * says free or names the waiter itself), found by the owner's tid that glibc keeps in
     * pthread_mutex_t.__owner (offset 8). An owner that is not a known thread of this process
     * (no owner any more, another C library's layout) leaves the GIL's holder as it was. */
    __u32 moff = 0;
    if (t->gil_mutex_off) {
        if (off >= t->gil_switch_mutex_off)
            moff = t->gil_switch_mutex_off;
        else if (off >= t->gil_mutex_off && off < t->gil_switch_off)
            moff = t->gil_mutex_off;
    }
    if (moff) {
        __u32 owner = 0;
        bpf_probe_read_user(&owner, sizeof(owner), (void *)(t->gil_addr + moff + 8));
        struct es_thread *o = owner && owner != tid ? bpf_map_lookup_elem(&threads, &owner) : 0;
        if (o && o->tgid == tgid && o->tstate) {
            holder = o->tstate;
            count(ES_C_GIL_MUTEX_OWNER);
        }
    }
    ev->h.ip = holder;
    if (holder && !is_off(ES_OFF_STACKS)) {
        struct es_walk_id id = {};
        flags |= walk_stack(t, holder, ev, slot, &id, 0) & (ES_EV_PARTIAL | ES_EV_TRUNCATED);
    }
    ev->h.flags = flags;
    submit(ev);
}

/* Only threads user space knows (with a PyThreadState) are traced off-CPU: a native thread
 * (BLAS/OpenMP pools, torch, gRPC) has no Python stack to blame, and engines have dozens of
 * them switching thousands of times a second. A switch-out of a still-runnable thread is
 * marked preempted. Inside sched_yield (a busy-wait loop: vLLM's shm_broadcast) it carries no
 * stack and user space gives the interval the thread's last known stack: two 32-byte records
 * per yield. Any other (preempted by the scheduler) walks the stack, as a sample does: the
 * last known stack can be another function's (a thread preempted right after dropping the GIL
 * on its way into a blocking read would otherwise be blamed on the function it sampled last),
 * and preemptions come at most once per time slice. Except with ES_TARGET_PREEMPT_LAST (the
 * agent): a preemption lands where the thread spends its CPU time, as a sample does, so the
 * last known stack is a draw from the same distribution, and an engine thread preempted
 * hundreds of times a second at as many different lines would fill an always-on recorder's
 * stack table and cost a walk in the scheduler each time. With GIL tracing, a thread falling asleep
 * on the GIL begins a GIL wait (before its switch-out record) and its switch-in ends it
 * (after its switch-in record). */
SEC("tp_btf/sched_switch")
int BPF_PROG(on_switch, _Bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int prev_state)
{
    if (is_off(ES_OFF_SWITCH))
        return 0;
    __u32 prev_tgid = BPF_CORE_READ(prev, tgid);
    const struct es_target *t = bpf_map_lookup_elem(&targets, &prev_tgid);
    if (t && (t->flags & (ES_TARGET_OFFCPU | ES_TARGET_GIL))) {
        __u32 tid = BPF_CORE_READ(prev, pid);
        struct es_thread *th = bpf_map_lookup_elem(&threads, &tid);
        int offcpu = t->flags & ES_TARGET_OFFCPU;
        int asleep = !preempt && prev_state != 0;
        if (!th || th->tgid != prev_tgid) {
            if (offcpu)
                count(ES_C_SWITCH_NATIVE);
        } else {
            if (asleep && (t->flags & ES_TARGET_GIL) && t->gil_addr)
                gil_wait_begins(t, prev_tgid, tid);
            if (!offcpu) {
                /* GIL waits only. */
            } else {
                /* The runtime as the scheduler has just brought it up to date (ip): with the
                 * switch-in's, what the thread ran of the time it was on its CPU. */
                __u64 runtime = BPF_CORE_READ(prev, se.sum_exec_runtime);
                count(ES_C_SWITCH_OUT);
                int walk = !is_off(ES_OFF_STACKS);
                if (asleep && walk)
                    record_current(ctx, ES_SLOT_SWITCH, ES_EV_SWITCH_OUT, t, prev_tgid, tid, runtime, 0, 0);
                else if (asleep)
                    /* The stack last walked stands for it. */
                    submit_header(ES_EV_SWITCH_OUT, ES_EV_SAME_STACK, prev_tgid, tid, runtime);
                else if ((!preempt && in_sched_yield()) || (t->flags & ES_TARGET_PREEMPT_LAST) || !walk)
                    /* Runs in prev's context: its memory is the current address space. */
                    submit_header(ES_EV_SWITCH_OUT, ES_EV_PREEMPTED, prev_tgid, tid, runtime);
                else
                    record_current(ctx, ES_SLOT_SWITCH, ES_EV_SWITCH_OUT, t, prev_tgid, tid, runtime, ES_EV_PREEMPTED, 0);
            }
        }
    }
    __u32 next_tgid = BPF_CORE_READ(next, tgid);
    t = bpf_map_lookup_elem(&targets, &next_tgid);
    if (t && (t->flags & (ES_TARGET_OFFCPU | ES_TARGET_GIL))) {
        __u32 tid = BPF_CORE_READ(next, pid);
        struct es_thread *th = bpf_map_lookup_elem(&threads, &tid);
        if (!th || th->tgid != next_tgid)
            return 0;
        if (t->flags & ES_TARGET_OFFCPU) {
            count(ES_C_SWITCH_IN);
            submit_header(ES_EV_SWITCH_IN, 0, next_tgid, tid, BPF_CORE_READ(next, se.sum_exec_runtime));
        }
        if ((t->flags & ES_TARGET_GIL) && bpf_map_lookup_elem(&gil_waiting, &tid)) {
            bpf_map_delete_elem(&gil_waiting, &tid);
            submit_header(ES_EV_GIL_WAIT_END, 0, next_tgid, tid, 0);
        }
    }
    return 0;
}

/* A thread of a target wakes another thread of the same process from a futex wait (sched_waking
 * runs in the waker's context: its memory is the current address space): what ended the
 * sleeper's off-CPU interval, and what the waker was running when it did (the function that
 * held the lock it released, or that notified the condition). Only wakes made inside a futex
 * wake call of a known thread: a timer's expiry or an I/O completion runs in whatever task an
 * interrupt met, which is not the waker. Wakes of a thread waiting for the GIL are left to the
 * GIL's own blame (its holder is read when the wait begins). */
SEC("tp_btf/sched_waking")
int BPF_PROG(on_waking, struct task_struct *p)
{
    __u32 tgid = BPF_CORE_READ(p, tgid);
    __u64 cur = bpf_get_current_pid_tgid();
    if ((__u32)(cur >> 32) != tgid || is_off(ES_OFF_SWITCH))
        return 0;
    const struct es_target *t = bpf_map_lookup_elem(&targets, &tgid);
    if (!t || !(t->flags & ES_TARGET_OFFCPU))
        return 0;
    __u32 wakee = BPF_CORE_READ(p, pid), waker = (__u32)cur;
    if (wakee == waker || bpf_map_lookup_elem(&gil_waiting, &wakee))
        return 0;
    struct es_thread *wt = bpf_map_lookup_elem(&threads, &wakee);
    if (!wt || wt->tgid != tgid)
        return 0;
    struct es_thread *ht = bpf_map_lookup_elem(&threads, &waker);
    if (!ht || ht->tgid != tgid || !ht->tstate)
        return 0;
    struct es_syscall sc = {};
    if (!current_syscall(&sc) || sc.nr != ES_NR_FUTEX)
        return 0;
    switch (sc.si & ES_FUTEX_CMD_MASK) {
    case ES_FUTEX_WAKE:
    case ES_FUTEX_REQUEUE:
    case ES_FUTEX_CMP_REQUEUE:
    case ES_FUTEX_WAKE_OP:
    case ES_FUTEX_UNLOCK_PI:
    case ES_FUTEX_WAKE_BITSET:
        break;
    default:
        return 0;
    }
    /* A wake on the GIL's own words (a thread dropping the GIL) is not a lock of the program's. */
    if (t->gil_addr && sc.di - t->gil_addr < t->gil_size)
        return 0;
    count(ES_C_WAKES);
    __u32 slot = ES_SLOT_WAKE;
    struct es_event *ev = bpf_map_lookup_elem(&scratch, &slot);
    if (!ev)
        return 0;
    ev->h.kind = ES_EV_WAKE;
    ev->h.tgid = tgid;
    ev->h.tid = wakee;
    ev->h.cpu = bpf_get_smp_processor_id();
    ev->h.time_ns = bpf_ktime_get_ns();
    ev->h.ip = waker;
    ev->h.nframes = 0;
    ev->h.flags = 0;
    if (!is_off(ES_OFF_STACKS)) {
        struct es_walk_id id = {};
        ev->h.flags = walk_stack(t, ht->tstate, ev, slot, &id, 0) & (ES_EV_PARTIAL | ES_EV_TRUNCATED);
    }
    submit(ev);
    return 0;
}

/* One GC edge (collection start 1, end 0) with the per-generation statistics. */
static __always_inline void gc_edge_out(const struct es_target *t, __u32 tgid, __u32 tid, __s64 value,
                                        __s64 generation)
{
    struct es_gc_edge ev = {};
    ev.h.kind = ES_EV_GC_EDGE;
    ev.h.tgid = tgid;
    ev.h.tid = tid;
    ev.h.cpu = bpf_get_smp_processor_id();
    ev.h.time_ns = bpf_ktime_get_ns();
    ev.h.ip = (__u64)value;
    ev.generation = generation;
    __u64 stats = t->gc_stats_addr;
    /* 3.15: follow gcstate->generation_stats to the rings. */
    if (stats && t->gc_stats_ring && bpf_probe_read_user(&stats, sizeof(stats), (void *)stats)) {
        count(ES_C_GC_READ_ERR);
        stats = 0;
    }
    if (stats) {
        for (int i = 0; i < 3; i++) {
            __u64 base = stats + (__u64)i * t->gc_stats_stride;
            if (t->gc_stats_ring) {
                /* The newest record of generation i: the GC writes it (a copy of the one
                 * before plus this collection) before the collector returns. */
                __u64 ring = stats + t->gc_ring_off[i];
                __u32 slots = t->gc_ring_slots[i];
                __u8 index = 0;
                if (bpf_probe_read_user(&index, sizeof(index), (void *)(ring + (__u64)slots * t->gc_stats_stride)) ||
                    index >= slots) {
                    count(ES_C_GC_READ_ERR);
                    continue;
                }
                base = ring + (__u64)index * t->gc_stats_stride + t->gc_ring_counts_off;
            }
            if (bpf_probe_read_user(&ev.collections[i], 8, (void *)base) ||
                bpf_probe_read_user(&ev.collected[i], 8, (void *)(base + 8)))
                count(ES_C_GC_READ_ERR);
        }
    }
    if (bpf_ringbuf_output(&events, &ev, sizeof(ev), BPF_RB_NO_WAKEUP))
        count(ES_C_RINGBUF_FULL);
}

/* Hardware write watchpoint on gcstate->collecting (cpu-wide, filtered by tgid): fires right
 * after the write, in the writing thread. */
SEC("perf_event")
int on_gc_write(struct bpf_perf_event_data *ctx)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tgid = pid_tgid >> 32;
    const struct es_target *t = bpf_map_lookup_elem(&targets, &tgid);
    if (!t || !(t->flags & ES_TARGET_GC))
        return 0;
    count(ES_C_GC_EDGES);
    int value = 0;
    if (bpf_probe_read_user(&value, sizeof(value), (void *)t->gc_collecting_addr)) {
        count(ES_C_GC_READ_ERR);
        return 0;
    }
    /* Off: no collection starts (its end is still sent, for one begun while on). */
    if (value && is_off(ES_OFF_GC))
        return 0;
    gc_edge_out(t, tgid, (__u32)pid_tgid, value, -1);
    return 0;
}

/* GC pauses where the interpreter has symbols: a uprobe on the collector function
 * (gc_collect_main on 3.13, _Py_RunGC and the gc.collect entry points on 3.12,
 * _PyGC_Collect on 3.14+; see find_collectors) and a uretprobe on its return. ~0.5 us
 * per hit (the functions begin with a push, which the kernel emulates) against ~14 us per
 * watchpoint trap, and no debug register. Per thread, calls nest: 3.13's gc_collect_main can
 * be entered while a collection runs (it returns at once); only the outermost call is a pause. */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, ES_MAX_THREADS);
    __type(key, __u32);
    __type(value, __u32);
} gc_depth SEC(".maps");


/* The GC uprobes fire in every process that maps the interpreter's file: the target whose
 * pauses they time (counted as a hit), or NULL where the process is not one. */
static __always_inline const struct es_target *gc_uprobe_target(__u32 *tgid, __u32 *tid)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    *tgid = pid_tgid >> 32;
    *tid = (__u32)pid_tgid;
    const struct es_target *t = bpf_map_lookup_elem(&targets, tgid);
    if (!t || !(t->flags & ES_TARGET_GC_UPROBE))
        return NULL;
    count(ES_C_GC_UPROBE_HITS);
    return t;
}

SEC("uprobe")
int on_gc_enter(struct pt_regs *ctx)
{
    if (is_off(ES_OFF_GC))
        return 0;
    __u32 tgid, tid;
    const struct es_target *t = gc_uprobe_target(&tgid, &tid);
    if (!t)
        return 0;
    __u32 *d = bpf_map_lookup_elem(&gc_depth, &tid);
    if (d && *d) {
        count(ES_C_GC_NESTED);
        if (*d < 64)
            *d += 1;
        return 0;
    }
    __u32 one = 1;
    bpf_map_update_elem(&gc_depth, &tid, &one, BPF_ANY);
    /* Cookie 1: the function's second argument is the generation. */
    __s64 generation = bpf_get_attach_cookie(ctx) ? (__s64)(int)PT_REGS_PARM2(ctx) : -1;
    gc_edge_out(t, tgid, tid, 1, generation);
    return 0;
}

/* The end of a collection: the collector's return (on_gc_exit) or, where the collection is
 * inlined into the allocator (3.10/3.11), the store that clears the collecting flag
 * (on_gc_clear). */
static __always_inline int gc_leave(void)
{
    __u32 tgid, tid;
    const struct es_target *t = gc_uprobe_target(&tgid, &tid);
    if (!t)
        return 0;
    __u32 *d = bpf_map_lookup_elem(&gc_depth, &tid);
    if (!d || !*d) {
        count(ES_C_GC_RETURN_UNPAIRED);
        return 0;
    }
    *d -= 1;
    if (*d)
        return 0;
    bpf_map_delete_elem(&gc_depth, &tid);
    gc_edge_out(t, tgid, tid, 0, -1);
    return 0;
}

SEC("uretprobe")
int on_gc_exit(struct pt_regs *ctx)
{
    return gc_leave();
}

/* A uprobe on the instruction that clears gcstate->collecting (it fires before the store). */
SEC("uprobe")
int on_gc_clear(struct pt_regs *ctx)
{
    return gc_leave();
}

/* Hardware write watchpoint on a probed code object's ob_refcnt, set per thread of the target:
 * fires right after the write (a frame of that code pushed: +1, popped: -1), in that thread.
 * The new value tells user space which of the two it was. */
SEC("perf_event")
int on_probe_hit(struct bpf_perf_event_data *ctx)
{
    if (is_off(ES_OFF_PROBE))
        return 0;
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
    const struct es_target *t = bpf_map_lookup_elem(&targets, &tgid);
    if (!t)
        return 0;
    count(ES_C_PROBE_HITS);
    struct es_probe_hit ev = {};
    ev.h.kind = ES_EV_PROBE_HIT;
    ev.h.tgid = tgid;
    ev.h.tid = tid;
    ev.h.cpu = bpf_get_smp_processor_id();
    ev.h.time_ns = bpf_ktime_get_ns();
    ev.h.ip = ctx->addr;
    if (bpf_probe_read_user(&ev.value, sizeof(ev.value), (void *)ctx->addr))
        count(ES_C_PROBE_NO_FRAME);
    struct es_thread *th = bpf_map_lookup_elem(&threads, &tid);
    __u64 f = 0;
    if (!th || th->tgid != tgid ||
        bpf_probe_read_user(&f, sizeof(f), (void *)(th->tstate + t->tstate_frame))) {
        count(ES_C_PROBE_NO_FRAME);
    } else if (t->cframe_current_frame >= 0 && f) {
        __u64 cf = f;
        f = 0;
        if (bpf_probe_read_user(&f, sizeof(f), (void *)(cf + t->cframe_current_frame)))
            count(ES_C_PROBE_NO_FRAME);
    }
    ev.frame = f;
    if (f) {
        __u64 prev = 0, code = 0;
        if (bpf_probe_read_user(&prev, sizeof(prev), (void *)(f + t->frame_previous)) ||
            bpf_probe_read_user(&code, sizeof(code), (void *)(f + t->frame_code)))
            count(ES_C_PROBE_NO_FRAME);
        ev.previous = prev;
        ev.code = code & ~t->code_tag_mask;
    }
    if (bpf_ringbuf_output(&events, &ev, sizeof(ev), BPF_RB_NO_WAKEUP))
        count(ES_C_RINGBUF_FULL);
    return 0;
}
