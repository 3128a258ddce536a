/** The few plotly.js calls the dashboard makes (plotly.js-dist-min ships no types). */
declare module 'plotly.js-dist-min' {
  export function react(root: HTMLElement, data: any[], layout: any, config?: any): Promise<HTMLElement>;
  export function purge(root: HTMLElement): void;
  export const Plots: { resize(root: HTMLElement): Promise<void> };
}
