"""A small least-recently-used cache and a word counter, the text strata perplexity scores in tests."""

import collections
import os
import sys


class LRUCache:
    """Keeps at most `capacity` items; the least recently used one is evicted first."""

    def __init__(self, capacity):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.items = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        if key in self.items:
            self.items.move_to_end(key)
            self.hits += 1
            return self.items[key]
        self.misses += 1
        return default

    def put(self, key, value):
        if key in self.items:
            self.items.move_to_end(key)
        self.items[key] = value
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def __len__(self):
        return len(self.items)

    def __contains__(self, key):
        return key in self.items

    def hit_rate(self):
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def count_words(path):
    """Returns a Counter of the words in the file at `path`, lower-cased."""
    counts = collections.Counter()
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            for word in line.split():
                word = word.strip(".,;:!?()[]{}\"'").lower()
                if word:
                    counts[word] += 1
    return counts


def most_common(counts, n=10):
    """The n most common words with their counts, most common first."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def fibonacci(n):
    """The first n Fibonacci numbers as a list."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


def is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def primes_below(limit):
    return [n for n in range(limit) if is_prime(n)]


def read_lines(path):
    with open(path) as f:
        return [line.rstrip("\n") for line in f]


def main(argv):
    if len(argv) < 2:
        print("usage: quality.py FILE", file=sys.stderr)
        return 2
    path = argv[1]
    if not os.path.exists(path):
        print(f"no such file: {path}", file=sys.stderr)
        return 1
    cache = LRUCache(128)
    counts = count_words(path)
    for word, count in most_common(counts, 20):
        cache.put(word, count)
        print(f"{word:20s} {count:6d}")
    print("primes:", primes_below(50))
    print("fibonacci:", fibonacci(12))
    print(f"hit rate: {cache.hit_rate():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
