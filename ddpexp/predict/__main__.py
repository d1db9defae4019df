import sys

from ddpexp.predict.cli import main

if __name__ == "__main__":
    sys.exit(main())
