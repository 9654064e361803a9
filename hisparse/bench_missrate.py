from hisparse.bench.missrate import main

if __name__ == "__main__":
    main()
