/* Native distinctive-token scan for the data-flow ledger (proxy/envelope/dataflow/fingerprint.py).
 *
 * folded_tokens(low) returns exactly what fingerprint._python_folded_tokens returns, for any str:
 * the matches of the plain patterns' `finditer` (leftmost, greedy, non-overlapping, with Python
 * `re`'s backtracking) of _EMAIL, _URL, _DOMAIN, _DIGITS and _IBAN_DIGITS, turned into tokens as
 * _url_tokens, _DATE and _NOT_DIGIT do. What each pattern's backtracking comes to is worked out
 * once, next to the loop that replaces it; the Python scans stay the reference (the tests compare
 * the two on texts dense in every pattern's characters).
 *
 * `re` on str reads `\d` as Py_UNICODE_ISDECIMAL, `\w` as Py_UNICODE_ISALNUM or "_", `\s` as
 * Py_UNICODE_ISSPACE, `\b` from `\w`; `[a-z]` and the other listed sets are ASCII only. The scans
 * read one byte per character (the text's `view`): the character itself when it is ASCII,
 * otherwise 0x80 plus the bits of the three Unicode classes the patterns ask about, so every test
 * is one table lookup. An ASCII str is its own view (no copy).
 *
 * Work is linear in the text whatever the text: every scan moves forward, and each character is
 * read a bounded number of times (said at each scan). Tokens are collected in a small buffer and
 * added to the result set whenever it fills, so memory is the set's plus a constant. On texts of
 * NOGIL_CHARS or more the scans run without the GIL (taken back to empty the buffer). An
 * allocation failure raises MemoryError: never a partial set.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

#define MIN_TOKEN 8      /* fingerprint.MIN_TOKEN */
#define NOGIL_CHARS 4096 /* below this, dropping and retaking the GIL costs more than it frees */
#define BUFFERED 256     /* tokens held before they are added to the set */

/* -- character classes ------------------------------------------------------------------------ */

/* The bits of a character that is not ASCII, in its view byte (0x80 | bits). */
enum { U_WORD = 1, U_DECIMAL = 2, U_SPACE = 4 };

/* What a view byte is: one bit per set the patterns use. */
enum {
    C_WORD = 1 << 0,    /* \w: str.isalnum() or "_" */
    C_DECIMAL = 1 << 1, /* \d: str.isdecimal() */
    C_DIGIT = 1 << 2,   /* str.isdigit() of an ASCII character (an IBAN's check: it reads only [a-z0-9 ]) */
    C_LOCAL = 1 << 3,   /* [a-z0-9._%+-]: an e-mail address's local part */
    C_HOST = 1 << 4,    /* [a-z0-9-]: an e-mail domain's label */
    C_LOWER = 1 << 5,   /* [a-z] */
    C_ALNUM = 1 << 6,   /* [a-z0-9] */
    C_SCHEME = 1 << 7,  /* [a-z0-9+.-] */
    C_LEAD = 1 << 8,    /* [0-9+.-]: what precedes a scheme's first letter in its run */
    C_BODY = 1 << 9,    /* [^\s<>"'`()\[\]{}|\\^]: a URL's body */
    C_PATH = 1 << 10,   /* [^\s<>"'`()\[\]{}]: a bare domain's path */
    C_SEP = 1 << 11,    /* [ .\-/()]: a separator in a digit run */
    C_RUN = 1 << 12,    /* [@\w.-]: what a bare domain never follows */
    C_TRAIL = 1 << 13,  /* fingerprint._TRAIL: stripped from a URL's end */
};

static uint16_t CLASS[256]; /* by view byte */
static uint8_t LATIN1[128]; /* the view byte of U+0080..U+00FF */

ALWAYS_INLINE int is(uint8_t byte, int cls) {
    return (CLASS[byte] & cls) != 0;
}

/* The view byte of a character that is not ASCII. */
static uint8_t wide_byte(Py_UCS4 c) {
    uint8_t bits = 0;
    if (Py_UNICODE_ISALNUM(c)) {
        bits |= U_WORD;
    }
    if (Py_UNICODE_ISDECIMAL(c)) {
        bits |= U_DECIMAL;
    }
    if (Py_UNICODE_ISSPACE(c)) {
        bits |= U_SPACE;
    }
    return (uint8_t)(0x80 | bits);
}

static int in(const char *set, int c) {
    return c != 0 && strchr(set, c) != NULL;
}

static void init_classes(void) {
    for (int c = 0; c < 128; c++) {
        int cls = 0, lower = c >= 'a' && c <= 'z', number = c >= '0' && c <= '9';
        int word = Py_UNICODE_ISALNUM(c) || c == '_', space = Py_UNICODE_ISSPACE(c);
        cls |= word ? C_WORD : 0;
        cls |= Py_UNICODE_ISDECIMAL(c) ? C_DECIMAL : 0;
        cls |= Py_UNICODE_ISDIGIT(c) ? C_DIGIT : 0;
        cls |= lower || number || in("._%+-", c) ? C_LOCAL : 0;
        cls |= lower || number || c == '-' ? C_HOST : 0;
        cls |= lower ? C_LOWER : 0;
        cls |= lower || number ? C_ALNUM : 0;
        cls |= lower || number || in("+.-", c) ? C_SCHEME : 0;
        cls |= number || in("+.-", c) ? C_LEAD : 0;
        cls |= !space && !in("<>\"'`()[]{}|\\^", c) ? C_BODY : 0;
        cls |= !space && !in("<>\"'`()[]{}", c) ? C_PATH : 0;
        cls |= in(" .-/()", c) ? C_SEP : 0;
        cls |= word || in("@.-", c) ? C_RUN : 0;
        cls |= in(".,;:!?'\")]}>*", c) ? C_TRAIL : 0;
        CLASS[c] = (uint16_t)cls;
    }
    for (int bits = 0; bits < 8; bits++) { /* no ASCII set holds a character that is not ASCII */
        int cls = 0;
        cls |= bits & U_WORD ? C_WORD | C_RUN : 0;
        cls |= bits & U_DECIMAL ? C_DECIMAL : 0;
        cls |= bits & U_SPACE ? 0 : C_BODY | C_PATH;
        CLASS[0x80 | bits] = (uint16_t)cls;
    }
    for (int c = 128; c < 256; c++) {
        LATIN1[c - 128] = wide_byte((Py_UCS4)c);
    }
}

/* The view of characters past Latin-1 is looked up in a small direct-mapped cache, one per call
 * (no state shared between threads): texts in one script repeat a few hundred characters, each
 * of which costs three Unicode database lookups the first time. An entry holds the character
 * (>= 256, so 0 is an empty entry) above its view byte. */
#define CACHED 2048

#define VIEW_LOOP(TYPE)                                                                   \
    do {                                                                                  \
        const TYPE *chars = (const TYPE *)data;                                           \
        for (Py_ssize_t i = 0; i < n; i++) {                                              \
            Py_UCS4 c = chars[i];                                                         \
            if (c < 128) {                                                                \
                view[i] = (uint8_t)c;                                                     \
            } else if (c < 256) {                                                         \
                view[i] = LATIN1[c - 128];                                                \
            } else {                                                                      \
                uint32_t *entry = &cache[c % CACHED];                                     \
                if (*entry >> 8 != c) {                                                   \
                    *entry = c << 8 | wide_byte(c);                                       \
                }                                                                         \
                view[i] = (uint8_t)*entry;                                                \
            }                                                                             \
        }                                                                                 \
    } while (0)

static void fill_view(int kind, const void *data, Py_ssize_t n, uint8_t *view) {
    uint32_t cache[CACHED];
    switch (kind) {
    case PyUnicode_1BYTE_KIND: {
        const Py_UCS1 *chars = (const Py_UCS1 *)data;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_UCS1 c = chars[i];
            view[i] = c < 128 ? c : LATIN1[c - 128];
        }
        break;
    }
    case PyUnicode_2BYTE_KIND:
        memset(cache, 0, sizeof(cache));
        VIEW_LOOP(Py_UCS2);
        break;
    default:
        memset(cache, 0, sizeof(cache));
        VIEW_LOOP(Py_UCS4);
    }
}

/* -- tokens ------------------------------------------------------------------------------------ */

enum kind { K_EMAIL, K_HOST, K_URL, K_NUMBER };
static PyObject *KINDS[4]; /* "email", "host", "url", "number", interned */

enum form {
    F_SPAN,     /* text[a:b] */
    F_JOIN,     /* text[a:b] + "/" + text[c:d] (a URL token: host "/" rest) */
    F_DECIMALS, /* the decimal digits of text[a:b] (_NOT_DIGIT.sub("", ...)) */
    F_NOSPACE,  /* text[a:b] without its spaces (an IBAN, compact) */
};

typedef struct {
    uint8_t kind, form;
    Py_ssize_t a, b, c, d;
} token;

typedef struct {
    PyObject *text;
    const uint8_t *v; /* the view */
    Py_ssize_t n;
    PyObject *found;       /* the result set */
    PyThreadState *saved;  /* while the GIL is released */
    int failed;            /* an exception is set: stop adding */
    Py_ssize_t count;
    token buffer[BUFFERED];
} scan;

/* Whether a token's value keeps v[i] (F_DECIMALS drops what is not a decimal, F_NOSPACE spaces). */
ALWAYS_INLINE int kept(const token *t, const uint8_t *v, Py_ssize_t i) {
    return !((t->form == F_DECIMALS && !is(v[i], C_DECIMAL)) || (t->form == F_NOSPACE && v[i] == ' '));
}

/* value_of for an ASCII text (its view is its characters): bytes copied. */
static PyObject *ascii_value_of(const uint8_t *v, const token *t) {
    Py_ssize_t length = t->form == F_JOIN ? (t->b - t->a) + 1 + (t->d - t->c) : 0;
    if (t->form != F_JOIN) {
        for (Py_ssize_t i = t->a; i < t->b; i++) {
            length += kept(t, v, i);
        }
    }
    PyObject *out = PyUnicode_New(length, 127);
    if (out == NULL) {
        return NULL;
    }
    Py_UCS1 *to = PyUnicode_1BYTE_DATA(out);
    if (t->form == F_JOIN) {
        memcpy(to, v + t->a, (size_t)(t->b - t->a));
        to += t->b - t->a;
        *to++ = '/';
        memcpy(to, v + t->c, (size_t)(t->d - t->c));
        return out;
    }
    for (Py_ssize_t i = t->a; i < t->b; i++) {
        if (kept(t, v, i)) {
            *to++ = v[i];
        }
    }
    return out;
}

/* A token's value as a new str (exactly as Python builds it: the narrowest kind that holds it). */
static PyObject *value_of(scan *sc, const token *t) {
    if (t->form == F_SPAN) {
        return PyUnicode_Substring(sc->text, t->a, t->b);
    }
    if (PyUnicode_IS_ASCII(sc->text)) {
        return ascii_value_of(sc->v, t);
    }
    int kind = PyUnicode_KIND(sc->text);
    const void *data = PyUnicode_DATA(sc->text);
    const uint8_t *v = sc->v;
    Py_ssize_t length = 0;
    Py_UCS4 widest = t->form == F_JOIN ? '/' : 0;
    for (int pass = 0; pass < 2; pass++) {
        PyObject *out = NULL;
        int okind = 0;
        void *odata = NULL;
        Py_ssize_t at = 0;
        if (pass == 1) {
            out = PyUnicode_New(length, widest);
            if (out == NULL) {
                return NULL;
            }
            okind = PyUnicode_KIND(out);
            odata = PyUnicode_DATA(out);
        }
        for (int part = 0; part < (t->form == F_JOIN ? 2 : 1); part++) {
            Py_ssize_t from = part ? t->c : t->a, to = part ? t->d : t->b;
            if (part) {
                if (pass) {
                    PyUnicode_WRITE(okind, odata, at++, '/');
                } else {
                    length++;
                }
            }
            for (Py_ssize_t i = from; i < to; i++) {
                if (!kept(t, v, i)) {
                    continue;
                }
                Py_UCS4 c = PyUnicode_READ(kind, data, i);
                if (pass) {
                    PyUnicode_WRITE(okind, odata, at++, c);
                } else {
                    length++;
                    widest = c > widest ? c : widest;
                }
            }
        }
        if (pass) {
            return out;
        }
    }
    return NULL; /* not reached */
}

/* Adds the buffered tokens to the set (with the GIL: taken back if released). */
static void flush(scan *sc) {
    if (sc->saved) {
        PyEval_RestoreThread(sc->saved);
    }
    for (Py_ssize_t i = 0; i < sc->count && !sc->failed; i++) {
        const token *t = &sc->buffer[i];
        PyObject *value = value_of(sc, t);
        PyObject *pair = value ? PyTuple_Pack(2, KINDS[t->kind], value) : NULL;
        Py_XDECREF(value);
        if (pair == NULL || PySet_Add(sc->found, pair) < 0) {
            sc->failed = 1;
        }
        Py_XDECREF(pair);
    }
    sc->count = 0;
    if (sc->saved) {
        sc->saved = PyEval_SaveThread();
    }
}

static void add(scan *sc, enum kind kind, enum form form, Py_ssize_t a, Py_ssize_t b,
                Py_ssize_t c, Py_ssize_t d) {
    if (sc->failed) {
        return;
    }
    sc->buffer[sc->count++] = (token){(uint8_t)kind, (uint8_t)form, a, b, c, d};
    if (sc->count == BUFFERED) {
        flush(sc);
    }
}

/* Whether v[i] is a word character (`\w`), False outside the text. */
ALWAYS_INLINE int word_at(const uint8_t *v, Py_ssize_t n, Py_ssize_t i) {
    return i >= 0 && i < n && is(v[i], C_WORD);
}

/* -- URL tokens (fingerprint._url_tokens) ------------------------------------------------------- */

/* fingerprint._FILE_TLDS: bare "domains" that are file names. */
static const char *const FILE_TLDS[] = {
    "txt", "md", "pdf", "doc", "docx", "xls", "xlsx", "csv", "json", "yaml", "yml", "py",
    "js", "ts", "html", "htm", "png", "jpg", "jpeg", "gif", "svg", "zip", "gz", "tar",
    "log", "ini", "cfg", "toml", "xml", "sh", "rs", "go", "java", "c", "h", "cpp", "rb",
    "php", "css",
};
#define FILE_TLD_COUNT (sizeof(FILE_TLDS) / sizeof(FILE_TLDS[0]))
#define LONGEST_FILE_TLD 4
static uint64_t FILE_TLD_KEYS[FILE_TLD_COUNT];

/* Up to LONGEST_FILE_TLD bytes and their count as one integer (equal keys: equal strings). */
static uint64_t tld_key(const uint8_t *bytes, size_t length) {
    uint64_t key = length;
    for (size_t i = 0; i < length; i++) {
        key = key << 8 | bytes[i];
    }
    return key;
}

static void init_file_tlds(void) {
    for (size_t i = 0; i < FILE_TLD_COUNT; i++) {
        FILE_TLD_KEYS[i] = tld_key((const uint8_t *)FILE_TLDS[i], strlen(FILE_TLDS[i]));
    }
}

/* Whether v[a:b] is one of FILE_TLDS (a view byte equals an ASCII byte only for that very
 * character). */
static int file_tld(const uint8_t *v, Py_ssize_t a, Py_ssize_t b) {
    if (b - a > LONGEST_FILE_TLD) {
        return 0;
    }
    uint64_t key = tld_key(v + a, (size_t)(b - a));
    for (size_t i = 0; i < FILE_TLD_COUNT; i++) {
        if (FILE_TLD_KEYS[i] == key) {
            return 1;
        }
    }
    return 0;
}

/* The host and url tokens of a URL or bare domain match text[a:b]: rstrip(_TRAIL), _SCHEME at
 * the start, removeprefix("www."), rstrip("/"), then the host (before the first "/", after the
 * last "@", before the first ":") must hold a dot and not end in a file extension. Lengths are
 * in code points, as Python's len. */
static void url_tokens(scan *sc, Py_ssize_t a, Py_ssize_t b) {
    const uint8_t *v = sc->v;
    while (b > a && is(v[b - 1], C_TRAIL)) {
        b--;
    }
    if (b > a && is(v[a], C_LOWER)) { /* ^[a-z][a-z0-9+.-]*:// (":" ends the scheme run) */
        Py_ssize_t j = a + 1;
        while (j < b && is(v[j], C_SCHEME)) {
            j++;
        }
        if (b - j >= 3 && v[j] == ':' && v[j + 1] == '/' && v[j + 2] == '/') {
            a = j + 3;
        }
    }
    if (b - a >= 4 && memcmp(v + a, "www.", 4) == 0) {
        a += 4;
    }
    while (b > a && v[b - 1] == '/') {
        b--;
    }
    Py_ssize_t slash = a;
    while (slash < b && v[slash] != '/') {
        slash++;
    }
    Py_ssize_t h0 = a, h1 = slash;
    for (Py_ssize_t i = h1; i > h0; i--) { /* rpartition("@")[2] */
        if (v[i - 1] == '@') {
            h0 = i;
            break;
        }
    }
    for (Py_ssize_t i = h0; i < h1; i++) { /* partition(":")[0] */
        if (v[i] == ':') {
            h1 = i;
            break;
        }
    }
    Py_ssize_t dot = h1;
    while (dot > h0 && v[dot - 1] != '.') {
        dot--;
    }
    if (dot == h0 || file_tld(v, dot, h1)) { /* no "." in the host, or a file name */
        return;
    }
    if (h1 - h0 >= MIN_TOKEN) {
        add(sc, K_HOST, F_SPAN, h0, h1, 0, 0);
    }
    Py_ssize_t rest = slash < b ? b - slash - 1 : 0;
    if (rest > 0 && (h1 - h0) + rest >= MIN_TOKEN - 1) {
        add(sc, K_URL, F_JOIN, h0, h1, slash + 1, b);
    }
}

/* -- e-mail addresses --------------------------------------------------------------------------- */

/* _EMAIL = [a-z0-9._%+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)*\.[a-z]{2,24}, after its "@" at q: where the
 * match ends, or -1. Every label is a whole run of [a-z0-9-] (a shorter one is followed by a
 * label character, never the "." that must come next), so the backtracking only chooses how many
 * of the labels after the first the star keeps: the most for which a "." and 2 or more letters
 * follow, the top-level domain being the next label's leading letters, at most 24 (nothing after
 * it in the pattern). */
static Py_ssize_t email_end(const uint8_t *v, Py_ssize_t n, Py_ssize_t q) {
    if (q >= n || !is(v[q], C_HOST)) {
        return -1;
    }
    Py_ssize_t r = q, end = -1;
    while (r < n && is(v[r], C_HOST)) {
        r++;
    }
    while (r + 1 < n && v[r] == '.' && is(v[r + 1], C_HOST)) {
        Py_ssize_t label = r + 1, letters = 0;
        while (letters < 24 && label + letters < n && is(v[label + letters], C_LOWER)) {
            letters++;
        }
        if (letters >= 2) {
            end = label + letters;
        }
        r = label;
        while (r < n && is(v[r], C_HOST)) {
            r++;
        }
    }
    return end;
}

/* finditer of _EMAIL. A match from any start inside a run of local-part characters reaches the
 * same "@" (the run holds none) with the same domain part, so each "@" is tried once, from the
 * start of its run or from where the previous match ended inside it. The scan back stops at the
 * previous "@" or match end, the domain scan at the next "@": each character read at most 3 times. */
static void scan_emails(scan *sc) {
    const uint8_t *v = sc->v;
    Py_ssize_t n = sc->n, pos = 0;
    while (pos < n) {
        const uint8_t *hit = memchr(v + pos, '@', (size_t)(n - pos));
        if (hit == NULL) {
            return;
        }
        Py_ssize_t at = hit - v, start = at;
        while (start > pos && is(v[start - 1], C_LOCAL)) {
            start--;
        }
        Py_ssize_t end = start < at ? email_end(v, n, at + 1) : -1;
        if (end < 0) {
            pos = at + 1;
            continue;
        }
        if (end - start >= MIN_TOKEN) {
            add(sc, K_EMAIL, F_SPAN, start, end, 0, 0);
            if (end - at - 1 >= MIN_TOKEN) {
                add(sc, K_HOST, F_SPAN, at + 1, end, 0, 0);
            }
        }
        pos = end;
    }
}

/* -- URLs --------------------------------------------------------------------------------------- */

/* The end of a run of URL body characters from q (the body is `+`: at least one, else -1). */
static Py_ssize_t body_end(const uint8_t *v, Py_ssize_t n, Py_ssize_t q) {
    if (q >= n || !is(v[q], C_BODY)) {
        return -1;
    }
    while (q < n && is(v[q], C_BODY)) {
        q++;
    }
    return q;
}

/* The next "://" at or after `from` (n when none): a memchr for the rare ":". */
static Py_ssize_t next_scheme(const uint8_t *v, Py_ssize_t n, Py_ssize_t from) {
    while (from < n) {
        const uint8_t *hit = memchr(v + from, ':', (size_t)(n - from));
        if (hit == NULL) {
            break;
        }
        Py_ssize_t at = hit - v;
        if (n - at >= 3 && v[at + 1] == '/' && v[at + 2] == '/') {
            return at;
        }
        from = at + 1;
    }
    return n;
}

/* The next "www." at or after `from` (n when none), found from its dot. */
static Py_ssize_t next_www(const uint8_t *v, Py_ssize_t n, Py_ssize_t from) {
    for (Py_ssize_t at = from + 3; at < n;) {
        const uint8_t *hit = memchr(v + at, '.', (size_t)(n - at));
        if (hit == NULL) {
            break;
        }
        at = hit - v;
        if (v[at - 1] == 'w' && v[at - 2] == 'w' && v[at - 3] == 'w') {
            return at - 3;
        }
        at++;
    }
    return n;
}

/* finditer of _URL = (?<![a-z0-9+.-])[0-9+.-]*+(?P<url>[a-z][a-z0-9+.-]*+://BODY)|(?P<www>www\.BODY),
 * the group as the URL. The first alternative's runs are possessive: it can only start a run of
 * scheme characters (its look-behind), takes the run's leading [0-9+.-], one letter and the rest
 * of the run, and needs "://" right after the run and at least one body character (the body is
 * greedy and ends the pattern). So its matches are found from the "://" that end runs, each run
 * read back over once; the second's from each "www."; the leftmost wins, the first alternative
 * on a tie (it is tried first at a position). A match ends before a character that is neither a
 * body nor a scheme character, so no run begins before `pos` (the previous match's end). */
static void scan_urls(scan *sc) {
    const uint8_t *v = sc->v;
    Py_ssize_t n = sc->n, pos = 0;
    Py_ssize_t scheme = next_scheme(v, n, 0), www = next_www(v, n, 0);
    Py_ssize_t start = -1, letter = -1, end = -1; /* the scheme's match, once found */
    Py_ssize_t www_end = -1;                      /* the www's, once found */
    for (;;) {
        while (scheme < n && end < 0) { /* the first "://" whose run starts a match */
            start = scheme;
            while (start > pos && is(v[start - 1], C_SCHEME)) {
                start--;
            }
            letter = start;
            while (letter < scheme && is(v[letter], C_LEAD)) {
                letter++; /* past them, a scheme character is a letter */
            }
            end = letter < scheme ? body_end(v, n, scheme + 3) : -1;
            if (end < 0) {
                scheme = next_scheme(v, n, scheme + 1);
            }
        }
        while (www < n && www_end < 0 && (www_end = body_end(v, n, www + 4)) < 0) {
            www = next_www(v, n, www + 1);
        }
        if (end >= 0 && (www_end < 0 || start <= www)) {
            if (end - letter >= MIN_TOKEN) {
                url_tokens(sc, letter, end);
            }
            pos = end;
        } else if (www_end >= 0) {
            if (www_end - www >= MIN_TOKEN) {
                url_tokens(sc, www, www_end);
            }
            pos = www_end;
        } else {
            return;
        }
        if (scheme < pos) { /* a "://" inside the match: the next one's run starts at or after pos */
            scheme = next_scheme(v, n, pos);
            end = -1;
        }
        if (www < pos) {
            www = next_www(v, n, pos);
            www_end = -1;
        }
    }
}

/* -- bare domains ------------------------------------------------------------------------------- */

/* _DOMAIN from p, after its look-behind: (?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.)+[a-z]{2,24}(?![\w-])
 * (?:/[^\s<>"'`()\[\]{}]*)?. Where the match ends, or -1. A label is a whole run of [a-z0-9-]
 * (only a "." may follow it) that starts and ends with [a-z0-9]; the `+` keeps the most labels
 * after which the letters that follow number 2 to 24 and are followed by neither a word
 * character nor "-" (a shorter count of letters is followed by a letter: the look-ahead fails).
 * Then the optional path, greedy. */
static Py_ssize_t domain_end(const uint8_t *v, Py_ssize_t n, Py_ssize_t p) {
    Py_ssize_t q = p, end = -1;
    while (q < n && is(v[q], C_ALNUM)) {
        Py_ssize_t r = q + 1;
        while (r < n && is(v[r], C_HOST)) {
            r++;
        }
        if (v[r - 1] == '-' || r >= n || v[r] != '.') {
            break;
        }
        q = r + 1;
        Py_ssize_t letters = 0;
        while (letters <= 24 && q + letters < n && is(v[q + letters], C_LOWER)) {
            letters++;
        }
        if (letters >= 2 && letters <= 24 && !word_at(v, n, q + letters) &&
            !(q + letters < n && v[q + letters] == '-')) {
            end = q + letters;
        }
    }
    if (end >= 0 && end < n && v[end] == '/') {
        end++;
        while (end < n && is(v[end], C_PATH)) {
            end++;
        }
    }
    return end;
}

/* finditer of _DOMAIN. Its look-behind (?<![@\w.-]) admits only the start of a run of [@\w.-],
 * and a match from there holds the run's first dot, right after the first label: so each run
 * with a dot is tried once, at its start, found by scanning back from that dot (not before
 * `pos`), and a run that does not start a match is skipped whole. The scan back stops at `pos`
 * only where no match can start: a previous match ends before a character that is not a label
 * character (its look-ahead, or its path's end), a skipped run before one not in the run. Each
 * character is read a bounded number of times. */
static void scan_domains(scan *sc) {
    const uint8_t *v = sc->v;
    Py_ssize_t n = sc->n, pos = 0;
    while (pos < n) {
        const uint8_t *hit = memchr(v + pos, '.', (size_t)(n - pos));
        if (hit == NULL) {
            return;
        }
        Py_ssize_t dot = hit - v, start = dot;
        while (start > pos && is(v[start - 1], C_RUN)) {
            start--;
        }
        if (is(v[start], C_ALNUM)) {
            Py_ssize_t end = domain_end(v, n, start);
            if (end >= 0) {
                if (end - start >= MIN_TOKEN) {
                    url_tokens(sc, start, end);
                }
                pos = end;
                continue;
            }
        }
        pos = dot + 1;
        while (pos < n && is(v[pos], C_RUN)) {
            pos++;
        }
    }
}

/* -- numbers ------------------------------------------------------------------------------------ */

/* _DATE.match(text[a:b]) for a digit run match (which starts and ends with a digit):
 * ^\d{4}[-./]\d{1,2}[-./]\d{1,2}$ or ^\d{1,2}[-./]\d{1,2}[-./]\d{4}$, i.e. three runs of
 * decimals split by one of "-./" each, of those lengths. */
static int is_date(const uint8_t *v, Py_ssize_t a, Py_ssize_t b) {
    Py_ssize_t runs[3], i = a;
    for (int j = 0; j < 3; j++) {
        Py_ssize_t from = i;
        while (i < b && is(v[i], C_DECIMAL)) {
            i++;
        }
        runs[j] = i - from;
        if (runs[j] == 0) {
            return 0;
        }
        if (j < 2) {
            if (i >= b || (v[i] != '-' && v[i] != '.' && v[i] != '/')) {
                return 0;
            }
            i++;
        }
    }
    return i == b && ((runs[0] == 4 && runs[1] <= 2 && runs[2] <= 2) ||
                      (runs[0] <= 2 && runs[1] <= 2 && runs[2] == 4));
}

/* The next decimal (`\d`) at or after p, or n. Eight ASCII bytes at a time: a block with no byte
 * in "0".."9" and none past ASCII (a view byte of a character that is not ASCII) holds none. */
static Py_ssize_t next_decimal(const uint8_t *v, Py_ssize_t n, Py_ssize_t p) {
    const uint64_t ones = 0x0101010101010101ULL, high = ones * 0x80;
    for (;;) {
        while (n - p >= 8) {
            uint64_t x;
            memcpy(&x, v + p, 8);
            uint64_t low = x & ~high; /* each byte's low 7 bits: the sums below never carry */
            uint64_t decimal = (low + ones * (0x80 - '0')) & ~(low + ones * (0x80 - '9' - 1)) & high;
            if ((decimal | (x & high)) != 0) {
                break;
            }
            p += 8;
        }
        Py_ssize_t stop = n - p > 8 ? p + 8 : n;
        for (; p < stop; p++) {
            if (is(v[p], C_DECIMAL)) {
                return p;
            }
        }
        if (p >= n) {
            return n;
        }
    }
}

/* _DIGITS = \d(?<!\w\d)(?:[ .\-/()]{0,2}\d){7,}(?![\w]) from p, after its look-behind: adds the
 * number it matches, if any, and returns where the scan goes on. Each repetition is determined
 * (0 to 2 separators, then the decimal that must follow: fewer separators leave a separator where
 * the decimal must be), so from a start the chain of repetitions is one; the greedy count
 * backtracks to the most repetitions, 7 or more, after which no word character follows. A start
 * that fails makes every later start in its chain fail (their repetitions end where its own do),
 * so the scan goes on past the chain: each character read twice. */
static Py_ssize_t digit_run(scan *sc, Py_ssize_t p) {
    const uint8_t *v = sc->v;
    Py_ssize_t n = sc->n, q = p + 1, end = -1;
    for (int count = 1;; count++) {
        Py_ssize_t r = q;
        if (r < n && is(v[r], C_SEP)) {
            r++;
            if (r < n && is(v[r], C_SEP)) {
                r++;
            }
        }
        if (r >= n || !is(v[r], C_DECIMAL)) {
            break;
        }
        q = r + 1;
        if (count >= 7 && !word_at(v, n, q)) {
            end = q;
        }
    }
    if (end < 0) {
        return q;
    }
    if (!is_date(v, p, end)) {
        add(sc, K_NUMBER, F_DECIMALS, p, end, 0, 0); /* 8 decimals or more: a token */
    }
    return end;
}

ALWAYS_INLINE int boundary(const uint8_t *v, Py_ssize_t n, Py_ssize_t i) {
    return word_at(v, n, i - 1) != word_at(v, n, i);
}

/* _IBAN_DIGITS after its two digits, from q: (?: ?[a-z0-9]{4}){2,7}(?: ?[a-z0-9]{1,4})?\b. Where
 * the match ends, or -1. Each group is determined (its space is taken when there is one: without
 * it, [a-z0-9] would have to match the space); the backtracking goes from the most groups (at most
 * 7) down to 2, and at each count tries the tail from its longest (up to 4) down to 1, then no
 * tail, the first followed by a word boundary winning. At most 44 characters: bounded. */
static Py_ssize_t iban_end(const uint8_t *v, Py_ssize_t n, Py_ssize_t q) {
    Py_ssize_t ends[8];
    int groups = 0;
    while (groups < 7) {
        Py_ssize_t r = q < n && v[q] == ' ' ? q + 1 : q;
        if (n - r < 4 || !is(v[r], C_ALNUM) || !is(v[r + 1], C_ALNUM) || !is(v[r + 2], C_ALNUM) ||
            !is(v[r + 3], C_ALNUM)) {
            break;
        }
        q = r + 4;
        ends[++groups] = q;
    }
    for (int g = groups; g >= 2; g--) {
        Py_ssize_t at = ends[g];
        Py_ssize_t r = at < n && v[at] == ' ' ? at + 1 : at;
        int tail = 0;
        while (tail < 4 && r + tail < n && is(v[r + tail], C_ALNUM)) {
            tail++;
        }
        for (; tail >= 1; tail--) {
            if (boundary(v, n, r + tail)) {
                return r + tail;
            }
        }
        if (boundary(v, n, at)) {
            return at;
        }
    }
    return -1;
}

/* finditer of _DIGITS and of _IBAN_DIGITS = \d(?<=\b[a-z]{2}\d)\d..., in one pass over the
 * decimals: a digit run starts at a decimal after a character that is not a word character, an
 * IBAN's digits at one after a letter, so no decimal starts both, and each keeps its own position
 * (where its previous match ended). The IBAN token is the IBAN from its two letters, without
 * spaces, when a digit (str.isdigit) follows its first four characters. */
static void scan_numbers(scan *sc) {
    const uint8_t *v = sc->v;
    Py_ssize_t n = sc->n, digits = 0, ibans = 0;
    for (Py_ssize_t p = next_decimal(v, n, 0); p < n; p = next_decimal(v, n, p + 1)) {
        if (!word_at(v, n, p - 1)) {
            if (p >= digits) {
                digits = digit_run(sc, p);
            }
            continue;
        }
        if (p < ibans || p < 2 || p + 1 >= n || !is(v[p - 1], C_LOWER) || !is(v[p - 2], C_LOWER) ||
            word_at(v, n, p - 3) || !is(v[p + 1], C_DECIMAL)) {
            continue;
        }
        Py_ssize_t end = iban_end(v, n, p + 2);
        if (end < 0) {
            continue;
        }
        for (Py_ssize_t i = p + 2; i < end; i++) {
            if (is(v[i], C_DIGIT)) {
                add(sc, K_NUMBER, F_NOSPACE, p - 2, end, 0, 0); /* 12 characters or more */
                break;
            }
        }
        ibans = end;
    }
}

/* -- the Python entry point --------------------------------------------------------------------- */

static PyObject *folded_tokens(PyObject *self, PyObject *arg) {
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "folded_tokens() argument must be str, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(arg) < 0) { /* a legacy str built from wchar_t gets its compact form */
        return NULL;
    }
#endif
    scan *sc = PyMem_Malloc(sizeof(scan));
    if (sc == NULL) {
        return PyErr_NoMemory();
    }
    sc->text = arg;
    sc->n = PyUnicode_GET_LENGTH(arg);
    sc->saved = NULL;
    sc->failed = 0;
    sc->count = 0;
    sc->found = PySet_New(NULL);
    if (sc->found == NULL) {
        PyMem_Free(sc);
        return NULL;
    }
    uint8_t *own = NULL;
    if (PyUnicode_IS_ASCII(arg)) {
        sc->v = PyUnicode_1BYTE_DATA(arg); /* immutable, and the caller holds a reference */
    } else {
        own = PyMem_RawMalloc(sc->n ? (size_t)sc->n : 1);
        if (own == NULL) {
            Py_DECREF(sc->found);
            PyMem_Free(sc);
            return PyErr_NoMemory();
        }
        sc->v = own;
    }
    if (sc->n >= NOGIL_CHARS) {
        sc->saved = PyEval_SaveThread();
    }
    if (own) {
        fill_view(PyUnicode_KIND(arg), PyUnicode_DATA(arg), sc->n, own);
    }
    if (sc->n > 0 && memchr(sc->v, '@', (size_t)sc->n)) {
        scan_emails(sc);
    }
    scan_urls(sc);
    scan_domains(sc);
    scan_numbers(sc);
    if (sc->count && !sc->failed) {
        flush(sc);
    }
    if (sc->saved) {
        PyEval_RestoreThread(sc->saved);
    }
    PyMem_RawFree(own);
    PyObject *found = sc->found;
    int failed = sc->failed;
    PyMem_Free(sc);
    if (failed) {
        Py_DECREF(found);
        return NULL;
    }
    return found;
}

static PyMethodDef methods[] = {
    {"folded_tokens", folded_tokens, METH_O,
     "folded_tokens(low) -> set[tuple[str, str]]: the distinctive tokens of a folded text "
     "(fingerprint.folded_tokens, exactly)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tokens",
    "Native distinctive-token scan (fingerprint.py's Python scans, exactly).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tokens(void) {
    static const char *const names[4] = {"email", "host", "url", "number"};
    init_classes();
    init_file_tlds();
    for (int i = 0; i < 4; i++) {
        if (KINDS[i] == NULL && (KINDS[i] = PyUnicode_InternFromString(names[i])) == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&module);
}
