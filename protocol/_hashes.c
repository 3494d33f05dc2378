/* Many SHA-256 digests in one call: the RFC 6962 leaf and node hashes of the archive's Merkle tree.
 *
 * Why this exists: hashlib's cost per digest (a new OpenSSL context, two Python objects, a copy to
 * prepend the domain byte) is several times the cost of hashing a 65-byte node or a 1 KiB event,
 * and the archiver and every verifier make two or three such digests per archived event. Here one
 * call hashes a whole list (and large lists are hashed without the GIL: see RELEASE_GIL_ABOVE).
 *
 * It also parses the archiver's batch reads (copy_rows_feed: PostgreSQL binary COPY rows of a sequence and
 * an event's bytes; infra/db/copy_rows.py), where one asyncpg Record per event cost more than the
 * bytes themselves.
 *
 * Both functions compute exactly what protocol/merkle.py's pure-Python fallbacks compute (the tests
 * compare them on random inputs): leaf_hashes(b) == [sha256(b"\x00" + x).digest() for x in b],
 * node_hashes(l) == [sha256(b"\x01" + l[i] + l[i + 1]).digest() for i in range(0, len(l) - 1, 2)].
 */
#define PY_SSIZE_T_CLEAN
/* OpenSSL's low-level SHA256_* calls, deprecated in 3.0 in favour of EVP but kept: measured, an EVP
 * context costs about 0.5 us per digest even when reused (a 65-byte node takes a tenth of that),
 * and these run the same assembly (SHA extensions where the CPU has them). */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define HASH_SIZE 32

/* The GIL is released only around work on at least this many input bytes (a segment's events:
 * its leaf hashes, its frames). Taking it back after a release waits for the thread holding it to
 * let go: measured in the archiver, whose encoding thread runs beside the event loop, releasing it
 * around every call, the small ones too (a level of a few node hashes), made encoding twice as
 * slow; around the large ones only, encoding overlaps the event loop's reading of the next rows. */
#define RELEASE_GIL_ABOVE (256 << 10)
#define BEGIN_MAYBE_UNLOCKED(bytes) \
    { \
        PyThreadState *saved_thread = (bytes) >= RELEASE_GIL_ABOVE ? PyEval_SaveThread() : NULL;
#define END_MAYBE_UNLOCKED \
    if (saved_thread != NULL) { \
        PyEval_RestoreThread(saved_thread); \
    } \
    }

/* Strong references to the items of `seq` (a list or tuple of bytes), with their buffers. */
typedef struct {
    Py_ssize_t count;
    PyObject **items;
    const char **data;
    Py_ssize_t *sizes;
} Inputs;

static void inputs_free(Inputs *in) {
    if (in->items != NULL) {
        for (Py_ssize_t i = 0; i < in->count; i++) {
            Py_XDECREF(in->items[i]);
        }
    }
    PyMem_Free(in->items);
    PyMem_Free(in->data);
    PyMem_Free(in->sizes);
    in->items = NULL;
    in->data = NULL;
    in->sizes = NULL;
}


/* Fill `in` from `seq`; every item must be bytes (of `exact` bytes when exact >= 0). */
static int inputs_take(PyObject *seq, Inputs *in, Py_ssize_t exact, const char *what) {
    PyObject *fast = PySequence_Fast(seq, "expected a list or tuple of bytes");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    in->count = n;
    in->items = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    in->data = PyMem_Calloc(n ? n : 1, sizeof(char *));
    in->sizes = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    if (in->items == NULL || in->data == NULL || in->sizes == NULL) {
        Py_DECREF(fast);
        inputs_free(in);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **src = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = src[i];
        if (!PyBytes_Check(item)) {
            Py_DECREF(fast);
            inputs_free(in);
            PyErr_Format(PyExc_TypeError, "%s must be bytes, not %.100s", what, Py_TYPE(item)->tp_name);
            return -1;
        }
        if (exact >= 0 && PyBytes_GET_SIZE(item) != exact) {
            Py_DECREF(fast);
            inputs_free(in);
            PyErr_Format(PyExc_ValueError, "%s must be %zd bytes", what, exact);
            return -1;
        }
        Py_INCREF(item);
        in->items[i] = item;
        in->data[i] = PyBytes_AS_STRING(item);
        in->sizes[i] = PyBytes_GET_SIZE(item);
    }
    Py_DECREF(fast);
    return 0;
}

/* A call's event bytes (``bodies``) and their sequences, as Inputs and a fast sequence the caller
   releases; -1 with an exception set, and nothing held, when either is not what it must be. */
static int events_take(PyObject *bodies, PyObject *sequences, Inputs *in, PyObject **seqs) {
    if (inputs_take(bodies, in, -1, "event bytes") < 0) {
        return -1;
    }
    *seqs = PySequence_Fast(sequences, "expected a list or tuple of sequences");
    if (*seqs == NULL) {
        inputs_free(in);
        return -1;
    }
    return 0;
}

/* The events' sequences (a fast sequence as long as ``in``) as unsigned 64-bit numbers, each and
   its event's length checked against the frame's fields, adding the bytes their frames take to
   ``*total``; -1 with an exception set on the first that does not fit. */
static int frame_numbers(PyObject *seqs, const Inputs *in, uint64_t *numbers, Py_ssize_t *total) {
    for (Py_ssize_t i = 0; i < in->count; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seqs, i));
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (v < 0 || in->sizes[i] > 0xffffffffLL) {
            PyErr_SetString(PyExc_ValueError, "a sequence or an event length is out of bounds");
            return -1;
        }
        numbers[i] = (uint64_t)v;
        *total += 16 + in->sizes[i];
    }
    return 0;
}


/* A list of `count` new 32-byte bytes objects cut from `digests`. */
static PyObject *digest_list(const unsigned char *digests, Py_ssize_t count) {
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *h = PyBytes_FromStringAndSize((const char *)digests + i * HASH_SIZE, HASH_SIZE);
        if (h == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, h);
    }
    return out;
}

/* SHA-256(prefix || a || b) of each job into out; 0 on success. Touches no Python object (may run without the GIL). */
static int hash_all(unsigned char prefix, Py_ssize_t jobs, const char **a, const Py_ssize_t *a_size,
                    const char **b, unsigned char *out) {
    SHA256_CTX ctx;
    int ok = 1;
    for (Py_ssize_t i = 0; i < jobs && ok; i++) {
        ok = SHA256_Init(&ctx) && SHA256_Update(&ctx, &prefix, 1) && SHA256_Update(&ctx, a[i], (size_t)a_size[i]) &&
             (b == NULL || SHA256_Update(&ctx, b[i], HASH_SIZE)) && SHA256_Final(out + i * HASH_SIZE, &ctx);
    }
    return ok ? 0 : -1;
}

PyDoc_STRVAR(leaf_hashes_doc,
             "leaf_hashes(bodies, /)\n--\n\n"
             "[SHA-256(0x00 || body) for body in bodies]: RFC 6962 leaf hashes, as a list of 32-byte bytes.");

static PyObject *leaf_hashes(PyObject *Py_UNUSED(module), PyObject *bodies) {
    Inputs in = {0};
    if (inputs_take(bodies, &in, -1, "event bytes") < 0) {
        return NULL;
    }
    unsigned char *digests = PyMem_Malloc(in.count ? in.count * HASH_SIZE : 1);
    if (digests == NULL) {
        inputs_free(&in);
        return PyErr_NoMemory();
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < in.count; i++) {
        total += in.sizes[i];
    }
    int rc;
    BEGIN_MAYBE_UNLOCKED(total)
    rc = hash_all(0x00, in.count, in.data, in.sizes, NULL, digests);
    END_MAYBE_UNLOCKED
    PyObject *out = rc == 0 ? digest_list(digests, in.count) : PyErr_Format(PyExc_RuntimeError, "SHA-256 failed");
    PyMem_Free(digests);
    inputs_free(&in);
    return out;
}

PyDoc_STRVAR(node_hashes_doc,
             "node_hashes(level, /)\n--\n\n"
             "[SHA-256(0x01 || level[i] || level[i + 1]) for i in range(0, len(level) - 1, 2)]: the RFC 6962\n"
             "interior nodes over neighbouring pairs of 32-byte hashes (an unpaired last one is left out).");

static PyObject *node_hashes(PyObject *Py_UNUSED(module), PyObject *level) {
    Inputs in = {0};
    if (inputs_take(level, &in, HASH_SIZE, "hashes") < 0) {
        return NULL;
    }
    Py_ssize_t pairs = in.count / 2;
    unsigned char *digests = PyMem_Malloc(pairs ? pairs * HASH_SIZE : 1);
    const char **left = PyMem_Malloc((pairs ? pairs : 1) * sizeof(char *));
    const char **right = PyMem_Malloc((pairs ? pairs : 1) * sizeof(char *));
    Py_ssize_t *sizes = PyMem_Malloc((pairs ? pairs : 1) * sizeof(Py_ssize_t));
    if (digests == NULL || left == NULL || right == NULL || sizes == NULL) {
        PyMem_Free(digests);
        PyMem_Free(left);
        PyMem_Free(right);
        PyMem_Free(sizes);
        inputs_free(&in);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < pairs; i++) {
        left[i] = in.data[2 * i];
        right[i] = in.data[2 * i + 1];
        sizes[i] = HASH_SIZE;
    }
    int rc;
    BEGIN_MAYBE_UNLOCKED(pairs * 2 * HASH_SIZE)
    rc = hash_all(0x01, pairs, left, sizes, right, digests);
    END_MAYBE_UNLOCKED
    PyObject *out = rc == 0 ? digest_list(digests, pairs) : PyErr_Format(PyExc_RuntimeError, "SHA-256 failed");
    PyMem_Free(digests);
    PyMem_Free(left);
    PyMem_Free(right);
    PyMem_Free(sizes);
    inputs_free(&in);
    return out;
}

/* --- CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as google_crc32c.value computes it --- */

static uint32_t crc_table[256];

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        }
        crc_table[i] = c;
    }
}

static uint32_t crc32c_table(uint32_t crc, const unsigned char *p, size_t n) {
    while (n--) {
        crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    }
    return crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) {
        crc = _mm_crc32_u8(crc, *p++);
    }
    return crc;
}
static int have_sse42 = 0;
#endif

/* CRC32C of the bytes [p, p + n), continuing from `crc` (0 for a fresh one). */
static uint32_t crc32c(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_sse42) {
        return ~crc32c_sse42(crc, p, n);
    }
#endif
    return ~crc32c_table(crc, p, n);
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static uint32_t get_be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static uint64_t get_be64(const unsigned char *p) { return (uint64_t)get_be32(p) << 32 | get_be32(p + 4); }

PyDoc_STRVAR(encode_frames_doc,
             "encode_frames(sequences, bodies, /)\n--\n\n"
             "The frames of a segment, concatenated: for each event, its length (u32) and sequence (u64),\n"
             "big-endian, its bytes, then the CRC32C (u32) of those three. The caller checks the bounds\n"
             "(lengths, sequence order) first; sequences must fit in 0..2**63-1.");

static PyObject *encode_frames(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode_frames(sequences, bodies)");
        return NULL;
    }
    Inputs in = {0};
    PyObject *seqs = NULL;
    if (events_take(args[1], args[0], &in, &seqs) < 0) {
        return NULL;
    }
    PyObject *out = NULL;
    uint64_t *numbers = NULL;
    if (PySequence_Fast_GET_SIZE(seqs) != in.count) {
        PyErr_SetString(PyExc_ValueError, "one sequence per event");
        goto done;
    }
    numbers = PyMem_Malloc((in.count ? in.count : 1) * sizeof(uint64_t));
    if (numbers == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    if (frame_numbers(seqs, &in, numbers, &total) < 0) {
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        goto done;
    }
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    BEGIN_MAYBE_UNLOCKED(total)
    for (Py_ssize_t i = 0; i < in.count; i++) {
        unsigned char *frame = w;
        put_be32(w, (uint32_t)in.sizes[i]);
        put_be32(w + 4, (uint32_t)(numbers[i] >> 32));
        put_be32(w + 8, (uint32_t)numbers[i]);
        memcpy(w + 12, in.data[i], (size_t)in.sizes[i]);
        w += 12 + in.sizes[i];
        put_be32(w, crc32c(0, frame, (size_t)(w - frame)));
        w += 4;
    }
    END_MAYBE_UNLOCKED
done:
    PyMem_Free(numbers);
    Py_DECREF(seqs);
    inputs_free(&in);
    return out;
}

PyDoc_STRVAR(build_segment_doc,
             "build_segment(header, sequences, bodies, /)\n--\n\n"
             "(segment, levels, root): the whole segment after `header` (its 88 bytes, packed by the caller,\n"
             "who also checked the events' bounds) in one pass over the events, each copied into its frame\n"
             "while its CRC32C, its leaf hash and the segment's SHA-256 are computed; `levels[h]` the\n"
             "perfect subtrees of height h over the leaves (protocol.merkle.Subtree), `root` their root.");

static PyObject *build_segment(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "build_segment(header: bytes, sequences, bodies)");
        return NULL;
    }
    const char *header = PyBytes_AS_STRING(args[0]);
    Py_ssize_t header_size = PyBytes_GET_SIZE(args[0]);
    Inputs in = {0};
    PyObject *seqs = NULL;
    if (events_take(args[2], args[1], &in, &seqs) < 0) {
        return NULL;
    }
    PyObject *out = NULL, *result = NULL, *levels = NULL;
    uint64_t *numbers = NULL;
    unsigned char *nodes = NULL;
    Py_ssize_t n = in.count;
    if (n < 1 || PySequence_Fast_GET_SIZE(seqs) != n) {
        PyErr_SetString(PyExc_ValueError, "one sequence per event, at least one event");
        goto done;
    }
    numbers = PyMem_Malloc(n * sizeof(uint64_t));
    /* Every level's nodes one after the other: n leaves, n / 2 pairs, ... (fewer than 2n in all). */
    nodes = PyMem_Malloc(2 * n * HASH_SIZE);
    if (numbers == NULL || nodes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = header_size + 2 * HASH_SIZE;
    if (frame_numbers(seqs, &in, numbers, &total) < 0) {
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        goto done;
    }
    unsigned char *start = (unsigned char *)PyBytes_AS_STRING(out);
    unsigned char *w = start, *root = NULL;
    int ok = 1, height = 0;
    Py_ssize_t level_at[64], level_count[64];
    BEGIN_MAYBE_UNLOCKED(total)
    SHA256_CTX segment, leaf;
    unsigned char leaf_prefix = 0x00, node_prefix = 0x01;
    ok = SHA256_Init(&segment);
    memcpy(w, header, (size_t)header_size);
    w += header_size;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        unsigned char *frame = w;
        put_be32(w, (uint32_t)in.sizes[i]);
        put_be32(w + 4, (uint32_t)(numbers[i] >> 32));
        put_be32(w + 8, (uint32_t)numbers[i]);
        memcpy(w + 12, in.data[i], (size_t)in.sizes[i]);
        w += 12 + in.sizes[i];
        put_be32(w, crc32c(0, frame, (size_t)(w - frame)));
        w += 4;
        ok = SHA256_Init(&leaf) && SHA256_Update(&leaf, &leaf_prefix, 1) &&
             SHA256_Update(&leaf, frame + 12, (size_t)in.sizes[i]) && SHA256_Final(nodes + i * HASH_SIZE, &leaf);
    }
    ok = ok && SHA256_Update(&segment, start, (size_t)(w - start));
    /* The perfect subtrees, level by level (an unpaired last node is not one: it stays out). */
    level_at[0] = 0;
    level_count[0] = n;
    while (ok && level_count[height] > 1) {
        Py_ssize_t below = level_at[height], count = level_count[height] / 2;
        level_at[height + 1] = below + level_count[height];
        level_count[height + 1] = count;
        for (Py_ssize_t j = 0; j < count && ok; j++) {
            SHA256_CTX node;
            ok = SHA256_Init(&node) && SHA256_Update(&node, &node_prefix, 1) &&
                 SHA256_Update(&node, nodes + (below + 2 * j) * HASH_SIZE, 2 * HASH_SIZE) &&
                 SHA256_Final(nodes + (level_at[height + 1] + j) * HASH_SIZE, &node);
        }
        height++;
    }
    /* The root: one perfect subtree per set bit of n, folded from the smallest (rightmost). */
    unsigned char acc[HASH_SIZE];
    int have = 0;
    for (int h = 0; h <= height && ok; h++) {
        if (!((n >> h) & 1)) {
            continue;
        }
        const unsigned char *peak = nodes + (level_at[h] + level_count[h] - 1) * HASH_SIZE;
        if (!have) {
            memcpy(acc, peak, HASH_SIZE);
            have = 1;
        } else {
            SHA256_CTX node;
            ok = SHA256_Init(&node) && SHA256_Update(&node, &node_prefix, 1) && SHA256_Update(&node, peak, HASH_SIZE) &&
                 SHA256_Update(&node, acc, HASH_SIZE) && SHA256_Final(acc, &node);
        }
    }
    root = w;
    memcpy(w, acc, HASH_SIZE);
    w += HASH_SIZE;
    ok = ok && SHA256_Update(&segment, root, HASH_SIZE) && SHA256_Final(w, &segment);
    END_MAYBE_UNLOCKED
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "SHA-256 failed");
        goto done;
    }
    levels = PyTuple_New(height + 1);
    if (levels == NULL) {
        goto done;
    }
    for (int h = 0; h <= height; h++) {
        PyObject *level = digest_list(nodes + level_at[h] * HASH_SIZE, level_count[h]);
        if (level == NULL) {
            goto done;
        }
        PyTuple_SET_ITEM(levels, h, level);
    }
    PyObject *root_bytes = PyBytes_FromStringAndSize((const char *)root, HASH_SIZE);
    if (root_bytes != NULL) {
        result = PyTuple_Pack(3, out, levels, root_bytes);
        Py_DECREF(root_bytes);
    }
done:
    Py_XDECREF(out);
    Py_XDECREF(levels);
    PyMem_Free(numbers);
    PyMem_Free(nodes);
    Py_DECREF(seqs);
    inputs_free(&in);
    return result;
}

PyDoc_STRVAR(scan_frames_doc,
             "scan_frames(data, start, end, count, max_length, bodies, /)\n--\n\n"
             "(sequences, event bytes or [], leaf hashes or []) of the `count` frames that exactly fill\n"
             "data[start:end], when every one is sound: length at most max_length, CRC32C matching,\n"
             "sequences strictly increasing. None at the first fault, without saying which (the caller's\n"
             "frame-by-frame walk names it). `bodies`: also the event bytes and their leaf hashes.");

static PyObject *scan_frames(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    Py_ssize_t start, end, count, max_length;
    int want_bodies;
    if (nargs != 6 || PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "scan_frames(data, start, end, count, max_length, bodies)");
        }
        return NULL;
    }
    PyObject *result = NULL;
    size_t *offsets = NULL;
    Py_ssize_t *lengths = NULL;
    uint64_t *numbers = NULL;
    unsigned char *digests = NULL;
    start = PyLong_AsSsize_t(args[1]);
    end = PyLong_AsSsize_t(args[2]);
    count = PyLong_AsSsize_t(args[3]);
    max_length = PyLong_AsSsize_t(args[4]);
    want_bodies = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred() || want_bodies < 0) {
        goto done;
    }
    if (start < 0 || end > view.len || start > end || count < 1) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    offsets = PyMem_Malloc(count * sizeof(size_t));
    lengths = PyMem_Malloc(count * sizeof(Py_ssize_t));
    numbers = PyMem_Malloc(count * sizeof(uint64_t));
    digests = PyMem_Malloc(want_bodies ? count * HASH_SIZE : 1);
    if (offsets == NULL || lengths == NULL || numbers == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *data = view.buf;
    int sound = 1;
    BEGIN_MAYBE_UNLOCKED(end - start)
    Py_ssize_t pos = start;
    for (Py_ssize_t i = 0; i < count && sound; i++) {
        if (end - pos < 16) {
            sound = 0;
            break;
        }
        uint32_t length = get_be32(data + pos);
        uint64_t sequence = get_be64(data + pos + 4);
        if ((Py_ssize_t)length > max_length || (Py_ssize_t)length > end - pos - 16 || sequence > 0x7fffffffffffffffULL ||
            (i > 0 && sequence <= numbers[i - 1]) ||
            crc32c(0, data + pos, 12 + (size_t)length) != get_be32(data + pos + 12 + length)) {
            sound = 0;
            break;
        }
        numbers[i] = sequence;
        offsets[i] = (size_t)pos + 12;
        lengths[i] = (Py_ssize_t)length;
        pos += 16 + (Py_ssize_t)length;
    }
    if (sound && pos != end) {
        sound = 0;
    }
    if (sound && want_bodies) {
        SHA256_CTX ctx;
        unsigned char prefix = 0x00;
        for (Py_ssize_t i = 0; i < count && sound; i++) {
            sound = SHA256_Init(&ctx) && SHA256_Update(&ctx, &prefix, 1) &&
                    SHA256_Update(&ctx, data + offsets[i], (size_t)lengths[i]) &&
                    SHA256_Final(digests + i * HASH_SIZE, &ctx);
        }
    }
    END_MAYBE_UNLOCKED
    if (!sound) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *sequences = PyList_New(count);
    PyObject *bodies = PyList_New(want_bodies ? count : 0);
    PyObject *leaves = want_bodies ? digest_list(digests, count) : PyList_New(0);
    if (sequences == NULL || bodies == NULL || leaves == NULL) {
        Py_XDECREF(sequences);
        Py_XDECREF(bodies);
        Py_XDECREF(leaves);
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *n = PyLong_FromUnsignedLongLong(numbers[i]);
        PyObject *b = want_bodies ? PyBytes_FromStringAndSize((const char *)data + offsets[i], lengths[i]) : NULL;
        if (n == NULL || (want_bodies && b == NULL)) {
            Py_XDECREF(n);
            Py_XDECREF(b);
            Py_DECREF(sequences);
            Py_DECREF(bodies);
            Py_DECREF(leaves);
            goto done;
        }
        PyList_SET_ITEM(sequences, i, n);
        if (want_bodies) {
            PyList_SET_ITEM(bodies, i, b);
        }
    }
    result = PyTuple_Pack(3, sequences, bodies, leaves);
    Py_DECREF(sequences);
    Py_DECREF(bodies);
    Py_DECREF(leaves);
done:
    PyMem_Free(offsets);
    PyMem_Free(lengths);
    PyMem_Free(numbers);
    PyMem_Free(digests);
    PyBuffer_Release(&view);
    return result;
}

/* --- PostgreSQL binary COPY rows of (bigint, text-or-bytea): the archiver's batch read --- */

/* One pass of the parser over `data[0..n)`: the header first when `header`, then every whole row,
 * appended to `sequences` and `bodies`. Stops at the trailer (*ended = 1) or at a row (or header)
 * that is not whole yet; *consumed is where the unparsed rest starts, *need how many bytes from
 * there it takes at least to go on. When `final`, nothing more will come: what is not whole is a
 * fault, the same one a parse of the whole output names (so a stream parsed in pieces and the
 * whole output parsed at once are refused alike). Returns the fault, or NULL (a Python error may
 * be set: then *consumed is meaningless). */
static const char *parse_copy(const unsigned char *data, Py_ssize_t n, int header, int final, PyObject *sequences,
                              PyObject *bodies, Py_ssize_t *consumed, Py_ssize_t *need, int *ended) {
    static const unsigned char signature[11] = {'P', 'G', 'C', 'O', 'P', 'Y', '\n', 0xff, '\r', '\n', 0};
    Py_ssize_t pos = 0;
    *ended = 0;
    *consumed = 0;
    *need = 0;
    if (header) {
        if (n < 19) {
            *need = 19;
            return final || (n >= 11 && memcmp(data, signature, 11) != 0) ? "not a binary COPY output (no signature)"
                                                                           : NULL;
        }
        if (memcmp(data, signature, 11) != 0) {
            return "not a binary COPY output (no signature)";
        }
        if (get_be32(data + 11) & 0xffff0000u) {
            return "binary COPY output with unknown critical flags";
        }
        uint32_t extension = get_be32(data + 15);
        if (extension > (uint64_t)(n - 19)) {
            *need = 19 + (Py_ssize_t)extension;
            return final ? "binary COPY header extension past the end" : NULL;
        }
        pos = 19 + (Py_ssize_t)extension;
    }
    for (;;) {
        *consumed = pos;
        if (n - pos < 2) {
            *need = 2;
            return final ? "binary COPY output ends without its trailer" : NULL;
        }
        int16_t fields = (int16_t)((data[pos] << 8) | data[pos + 1]);
        if (fields == -1) {
            *consumed = pos + 2;
            *ended = 1;
            return pos + 2 != n ? "bytes after the binary COPY trailer" : NULL;
        }
        if (fields != 2) {
            return "binary COPY row without exactly two fields";
        }
        if ((n - pos >= 6 && get_be32(data + pos + 2) != 8) || (final && n - pos < 18)) {
            return "binary COPY row whose first field is not an 8-byte integer";
        }
        if (n - pos < 18) {
            *need = 18;
            return NULL;
        }
        int64_t number = (int64_t)get_be64(data + pos + 6);
        uint32_t length = get_be32(data + pos + 14);
        if (length == 0xffffffffu) {
            return "binary COPY row whose second field is NULL";
        }
        if (length > 0x7fffffffu) { /* negative as PostgreSQL's int32 (the Python parser's view): never whole */
            return "binary COPY row whose second field runs past the end";
        }
        if (length > (uint64_t)(n - pos - 18)) {
            *need = 18 + (Py_ssize_t)length;
            return final ? "binary COPY row whose second field runs past the end" : NULL;
        }
        PyObject *item = PyLong_FromLongLong(number);
        if (item == NULL || PyList_Append(sequences, item) < 0) {
            Py_XDECREF(item);
            return NULL;
        }
        Py_DECREF(item);
        item = PyBytes_FromStringAndSize((const char *)data + pos + 18, (Py_ssize_t)length);
        if (item == NULL || PyList_Append(bodies, item) < 0) {
            Py_XDECREF(item);
            return NULL;
        }
        Py_DECREF(item);
        pos += 18 + (Py_ssize_t)length;
    }
}

PyDoc_STRVAR(copy_rows_feed_doc,
             "copy_rows_feed(data, header, final, sequences, bodies, /)\n--\n\n"
             "Parse a piece of a PostgreSQL binary COPY output whose rows are (bigint, text or bytea),\n"
             "neither NULL: the header first when `header`, then the whole rows, appended to the lists. (consumed, need, ended): where the\n"
             "unparsed rest of `data` starts, the bytes it takes at least from there to go on, and whether\n"
             "the trailer was read. `final`: nothing follows `data`, so a row cut short is refused.\n"
             "ValueError naming the first thing that is not a binary COPY output of such rows: the\n"
             "signature, flags and header extension, then each row's field count (2), a 4-byte length and\n"
             "8-byte big-endian integer, a 4-byte length and that many bytes, then the trailer (-1) and\n"
             "nothing after it.");

static PyObject *copy_rows_feed(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[3]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "copy_rows_feed(data, header, final, sequences: list, bodies: list)");
        return NULL;
    }
    int header = PyObject_IsTrue(args[1]), final = PyObject_IsTrue(args[2]);
    if (header < 0 || final < 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t consumed, need;
    int ended;
    PyObject *result = NULL;
    const char *fault = parse_copy(view.buf, view.len, header, final, args[3], args[4], &consumed, &need, &ended);
    if (fault != NULL) {
        PyErr_SetString(PyExc_ValueError, fault);
    } else if (!PyErr_Occurred()) {
        result = Py_BuildValue("(nnO)", consumed, need, ended ? Py_True : Py_False);
    }
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(crc32c_doc, "crc32c(data, /)\n--\n\nThe CRC32C of `data` (what google_crc32c.value gives).");

static PyObject *crc32c_value(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint32_t crc = crc32c(0, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyMethodDef methods[] = {
    {"leaf_hashes", leaf_hashes, METH_O, leaf_hashes_doc},
    {"node_hashes", node_hashes, METH_O, node_hashes_doc},
    {"encode_frames", (PyCFunction)(void (*)(void))encode_frames, METH_FASTCALL, encode_frames_doc},
    {"build_segment", (PyCFunction)(void (*)(void))build_segment, METH_FASTCALL, build_segment_doc},
    {"scan_frames", (PyCFunction)(void (*)(void))scan_frames, METH_FASTCALL, scan_frames_doc},
    {"crc32c", crc32c_value, METH_O, crc32c_doc},
    {"copy_rows_feed", (PyCFunction)(void (*)(void))copy_rows_feed, METH_FASTCALL, copy_rows_feed_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "protocol._hashes",
    "Batched RFC 6962 leaf and node hashes (SHA-256), for protocol.merkle.", -1, methods,
};

PyMODINIT_FUNC PyInit__hashes(void) {
    crc_table_init();
#if defined(__x86_64__) && defined(__GNUC__)
    have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
    return PyModule_Create(&module);
}
