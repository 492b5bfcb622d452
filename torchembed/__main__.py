from torchembed.cli import main

raise SystemExit(main())
