# %% [markdown]
# # Sales by region
# A small data analysis as an LLM would write it: build a table, summarise it, plot it, save the results
# to /mnt/data so they come back as files.

# %%
import numpy as np
import pandas as pd

rng = np.random.default_rng(7)
sales = pd.DataFrame({
    "region": rng.choice(["north", "south", "east", "west"], size=400),
    "units": rng.integers(1, 50, size=400),
    "price": rng.normal(20, 4, size=400).round(2),
})
sales["revenue"] = sales["units"] * sales["price"]
summary = sales.groupby("region")["revenue"].agg(["count", "sum", "mean"]).round(1)
print(summary)

# %%
import matplotlib.pyplot as plt

ax = summary["sum"].plot.bar(color="#4c72b0", title="Revenue by region")
ax.set_ylabel("revenue")
plt.tight_layout()
plt.savefig("/mnt/data/revenue.png")
plt.show()

# %%
summary.to_csv("/mnt/data/summary.csv")
print(f"best region: {summary['sum'].idxmax()}")
